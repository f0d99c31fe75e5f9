"""Plans that experts write by hand, as layouts for the same solver.

A hand plan fixes where every parameter is stored and how the user's inputs are split;
the solver then fills in the cheapest activation layouts consistent with them, so the
result is a complete, runnable Plan priced by the same cost model as autopar's own
(which can only be cheaper or equal, since it may also choose those layouts). A hand
plan here is therefore the *best* plan of its style, a strict baseline.

    data_parallel  every parameter replicated; inputs split by batch on every axis
    megatron       column-parallel layers (q/k/v, gate/up, c_attn, c_fc, intermediate)
                   split their output dim, row-parallel layers (o_proj, down_proj,
                   c_proj, output.dense) their input dim, over the whole mesh; the LM
                   head and the embedding tables split the vocabulary where it divides
                   (vocab-parallel embedding); norms replicated; inputs replicated
    dp_tp          Megatron on the last mesh axis, data parallel on the others
    fsdp           every parameter stored split along its first dim over the whole mesh
                   (ZeRO-3) and gathered where it is used; inputs split by batch

Context parallelism (torchtitan's and Megatron's, with keys and values all-gathered):
the inputs split along the sequence (dim 1) and every attention keeps its query rows
split the same way, its keys and values gathered (passes/rules/nn.py sdpa); the solver
lays out the rest.

    cp             parameters replicated; sequence over the whole mesh
    dp_cp          parameters replicated; batch over the outer axes, sequence over the last
    fsdp_cp        parameters as fsdp; sequence over the whole mesh
    tp_cp          Megatron on the last axis (attention split by heads there), sequence
                   over the others
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Optional

import torch
from torch import nn

from autopar.core.errors import HandPlanError
from autopar.core.mesh import Mesh
from autopar.core.placement import Placement, R, Shard, Spec, TensorMeta, canonical
from autopar.passes.plan.planning import options_with, plan_traced, trace_for_planning
from autopar.passes.strategies.strategies import OpOutput

aten = torch.ops.aten

ROW_PARALLEL = re.compile(r"(o_proj|down_proj|c_proj|out_proj|fc2|dense_4h_to_h|attention\.output\.dense|"
                          r"\.output\.dense|wo|w2)$")


@dataclass(frozen=True)
class HandLayout:
    params: dict[str, tuple[Placement, ...]]  # state-dict key -> placements per mesh axis
    batch_axes: tuple[int, ...]  # mesh axes the inputs' dim 0 is split over
    seq_axes: tuple[int, ...] = ()  # mesh axes the inputs' dim 1 and attention's query rows are split over
    head_axes: tuple[int, ...] = ()  # mesh axes attention is split by heads over (tensor parallel)


def _kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.Linear):
        return "linear"  # weight [out, in]
    if type(module).__name__ == "Conv1D":
        return "conv1d"  # transformers' GPT-2 layer: weight [in, out]
    return None


def _on(axes: tuple[int, ...], placement: Placement, mesh_shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """`placement` on `axes` (axes of size 1 stay R, as the strategies have them)."""
    return tuple(placement if a in axes and n > 1 else R for a, n in enumerate(mesh_shape))


def tensor_parallel_params(model: nn.Module, mesh_shape: tuple[int, ...], tp_axes: tuple[int, ...]) -> dict:
    """Megatron's column/row split of every linear layer, and the vocabulary split of
    every embedding table, over `tp_axes` (where it divides)."""
    ndim, ways = len(mesh_shape), prod(mesh_shape[a] for a in tp_axes)
    pins: dict[str, tuple] = {}
    for name, module in model.named_modules():
        kind = _kind(module)
        for pname, param in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            pins[full] = (R,) * ndim
            if isinstance(module, nn.Embedding) and pname == "weight" and param.shape[0] % ways == 0:
                pins[full] = _on(tp_axes, Shard(0), mesh_shape)  # vocab-parallel embedding
            if kind is None:
                continue
            row = bool(ROW_PARALLEL.search(name))
            out_dim, in_dim = (0, 1) if kind == "linear" else (1, 0)
            if pname == "weight":
                dim = in_dim if row else out_dim
                if param.shape[dim] % ways == 0:
                    pins[full] = _on(tp_axes, Shard(dim), mesh_shape)
            elif pname == "bias" and not row and param.shape[0] % ways == 0:
                pins[full] = _on(tp_axes, Shard(0), mesh_shape)
    return pins


def data_parallel(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    ndim = len(mesh_shape)
    return HandLayout({n: (R,) * ndim for n, _ in model.named_parameters(remove_duplicate=False)},
                      tuple(range(ndim)))


def megatron(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    return HandLayout(tensor_parallel_params(model, mesh_shape, tuple(range(len(mesh_shape)))), ())


def dp_tp(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    ndim = len(mesh_shape)
    return HandLayout(tensor_parallel_params(model, mesh_shape, (ndim - 1,)), tuple(range(ndim - 1)))


def fsdp(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    ndim, ways = len(mesh_shape), prod(mesh_shape)
    all_axes = _all_axes(mesh_shape)
    params = {n: _on(all_axes, Shard(0), mesh_shape) if p.ndim and p.shape[0] % ways == 0 else (R,) * ndim
              for n, p in model.named_parameters(remove_duplicate=False)}
    return HandLayout(params, all_axes)


def _all_axes(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(range(len(mesh_shape)))


def _replicated(model: nn.Module, mesh_shape: tuple[int, ...]) -> dict:
    return {n: (R,) * len(mesh_shape) for n, _ in model.named_parameters(remove_duplicate=False)}


def cp(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    return HandLayout(_replicated(model, mesh_shape), (), seq_axes=_all_axes(mesh_shape))


def dp_cp(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    ndim = len(mesh_shape)
    return HandLayout(_replicated(model, mesh_shape), tuple(range(ndim - 1)), seq_axes=(ndim - 1,))


def fsdp_cp(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    return HandLayout(fsdp(model, mesh_shape).params, (), seq_axes=_all_axes(mesh_shape))


def tp_cp(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    ndim = len(mesh_shape)
    return HandLayout(tensor_parallel_params(model, mesh_shape, (ndim - 1,)), (), seq_axes=tuple(range(ndim - 1)),
                      head_axes=(ndim - 1,))


STYLES: dict[str, Callable[[nn.Module, tuple[int, ...]], HandLayout]] = {
    "data_parallel": data_parallel, "megatron": megatron, "dp_tp": dp_tp, "fsdp": fsdp,
    "cp": cp, "dp_cp": dp_cp, "fsdp_cp": fsdp_cp, "tp_cp": tp_cp}


def _split(meta: TensorMeta, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> tuple:
    """`placements` where the tensor takes them (evenly, or torch.chunk blocks on one axis
    leaving no rank empty), else replicated."""
    spec = Spec(canonical(placements, meta.shape, mesh_shape), meta)
    return spec.placements if spec.fits(mesh_shape, uneven=True) else (R,) * len(mesh_shape)


def _layout(dims: dict[int, tuple[int, ...]], ndim: int, mesh_shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """Tensor dim -> the mesh axes splitting it, as placements per mesh axis (dims the
    tensor lacks are dropped)."""
    out: list[Placement] = [R] * len(mesh_shape)
    for dim, axes in dims.items():
        for a in axes:
            if dim < ndim and mesh_shape[a] > 1:
                out[a] = Shard(dim)
    return tuple(out)


def input_pins(traced, mesh_shape: tuple[int, ...], batch_axes: tuple[int, ...],
               seq_axes: tuple[int, ...] = (), style: str = "") -> dict[int, tuple]:
    """User input index -> placements: dim 0 split over `batch_axes` where it takes the
    split, dim 1 over `seq_axes` (a HandPlanError where it cannot: the style's point)."""
    pins = {}
    for gi in traced.inputs:
        if gi.kind != "user_input":
            continue
        if gi.meta.ndim >= 2 and seq_axes:
            label = traced.input_paths[gi.target] if gi.target < len(traced.input_paths) else gi.name
            _check_sequence(gi, label, mesh_shape, seq_axes, style)
        want = _layout({0: batch_axes, 1: seq_axes}, gi.meta.ndim, mesh_shape)
        got = _split(gi.meta, want, mesh_shape)
        if got != want and seq_axes:  # keep the sequence split, drop the batch one
            got = _split(gi.meta, _layout({1: seq_axes}, gi.meta.ndim, mesh_shape), mesh_shape)
        pins[gi.target] = got
    return pins


def _check_sequence(gi, label: str, mesh_shape: tuple[int, ...], seq_axes: tuple[int, ...], style: str) -> None:
    want = _layout({1: seq_axes}, gi.meta.ndim, mesh_shape)
    if _split(gi.meta, want, mesh_shape) == want:
        return
    ways, n = prod(mesh_shape[a] for a in seq_axes), gi.meta.shape[1]
    raise HandPlanError(
        f"hand-plan style {style!r} splits the sequence (dim 1) of input {label} ({n} positions) {ways} ways over "
        f"mesh axes {seq_axes}, which it cannot: an uneven split must be on one axis and leave no rank empty "
        f"(blocks of {-(-n // ways)}); use a length that divides {ways}, or a style that splits the sequence "
        "over one axis (dp_cp, tp_cp)")


def attention_pins(traced, mesh_shape: tuple[int, ...], layout: HandLayout) -> dict[OpOutput, tuple]:
    """Every attention's output [B, H, L, E] split by batch, heads and query rows over the
    layout's axes (context parallelism), where it takes the split; none without seq_axes."""
    if not layout.seq_axes:
        return {}
    pins = {}
    for node in traced.gm.graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
            meta = TensorMeta.of(node.meta["val"])
            kv_heads = node.args[1].meta["val"].shape[1]
            # heads split where the key/value heads divide too (else replicated there, as
            # Megatron keeps key/value heads whole when there are fewer than ranks)
            heads = tuple(a for a in layout.head_axes if kv_heads % mesh_shape[a] == 0)
            want = _layout({0: layout.batch_axes, 1: heads, 2: layout.seq_axes}, meta.ndim, mesh_shape)
            if _split(meta, want, mesh_shape) == want:  # else the solver lays it out
                pins[OpOutput(node.name)] = want
    return pins


def hand_pins(model: nn.Module, traced, mesh_shape: tuple[int, ...], style: str) -> dict:
    """Parameter, user-input and attention layouts of `style` for the traced model (the
    `pinned` argument of autopar.passes.plan.planning.plan_traced)."""
    if style not in STYLES:
        raise HandPlanError(f"unknown hand-plan style {style!r}; choose one of {sorted(STYLES)}")
    layout = STYLES[style](model, mesh_shape)
    return {**layout.params, **input_pins(traced, mesh_shape, layout.batch_axes, layout.seq_axes, style),
            **attention_pins(traced, mesh_shape, layout)}


def hand_plan(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, mesh: Any,
              style: str = "megatron", **option_overrides: Any):
    """The best complete Plan whose parameters and inputs are laid out as `style` prescribes."""
    mesh_ = Mesh.of(mesh)
    if style not in STYLES:  # before tracing: a typo should not cost a trace
        raise HandPlanError(f"unknown hand-plan style {style!r}; choose one of {sorted(STYLES)}")
    traced = trace_for_planning(model, args, kwargs)
    return plan_traced(traced, mesh_, options_with(None, option_overrides), hand_pins(model, traced, mesh_.shape, style))[1]
