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
    fsdp_tp        torchtitan's 2-D: Megatron on the last axis, each parameter's first dim
                   (within its Megatron block) stored split over the others and gathered
                   where used; inputs split by batch over the others

Context parallelism (torchtitan's and Megatron's, with keys and values all-gathered):
the inputs split along the sequence (dim 1) and every attention keeps its query rows
split the same way, its keys and values gathered (passes/rules/nn.py sdpa); the solver
lays out the rest.

    cp             parameters replicated; sequence over the whole mesh
    dp_cp          parameters replicated; batch over the outer axes, sequence over the last
    fsdp_cp        parameters as fsdp; sequence over the whole mesh
    tp_cp          Megatron on the last axis (attention split by heads there), sequence
                   over the others

Expert parallelism (torchtitan's FSDP with EP): the routed experts' weights (parameters
of three dims under an `experts` module) split by expert over the last axis, every
routed_experts node (autopar/core/routed.py) split by rows, so each row travels to its
expert's rank and back; every other parameter as fsdp.

    ep             experts over the last axis; the rest fsdp; inputs by batch over every axis
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
from autopar.core.options import Options
from autopar.core.pipeline import PipelineAxis, check_request, stage_mesh
from autopar.core.placement import Placement, R, Shard, Spec, TensorMeta, canonical
from autopar.core.routed import ROUTED_EXPERTS
from autopar.passes.plan import pipeline
from autopar.passes.plan.planning import options_with, plan_traced, planning_inputs, trace_for_planning
from autopar.passes.strategies.strategies import OpInput, OpOutput

aten = torch.ops.aten

ROW_PARALLEL = re.compile(r"(o_proj|down_proj|c_proj|out_proj|fc2|dense_4h_to_h|attention\.output\.dense|"
                          r"\.output\.dense|wo|w2)$")


@dataclass(frozen=True)
class HandLayout:
    params: dict[str, tuple[Placement, ...]]  # state-dict key -> placements per mesh axis
    batch_axes: tuple[int, ...]  # mesh axes the inputs' dim 0 is split over
    seq_axes: tuple[int, ...] = ()  # mesh axes the inputs' dim 1 and attention's query rows are split over
    head_axes: tuple[int, ...] = ()  # mesh axes attention is split by heads over (tensor parallel)
    expert_axes: tuple[int, ...] = ()  # mesh axes the routed experts are split over (expert parallelism)


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


def fsdp_tp(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    """torchtitan's 2-D layout: Megatron on the last axis, and every parameter's first dim
    (within its tensor-parallel block) stored split over the other axes and gathered
    where it is used; inputs split by batch over the other axes."""
    ndim = len(mesh_shape)
    if ndim < 2:
        raise HandPlanError(f"hand-plan style 'fsdp_tp' puts Megatron on the last mesh axis and FSDP on the others: "
                            f"mesh {mesh_shape} has one axis; use fsdp or megatron")
    dp_axes, last = tuple(range(ndim - 1)), ndim - 1
    dp_ways = prod(mesh_shape[a] for a in dp_axes)
    params = tensor_parallel_params(model, mesh_shape, (last,))
    shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    for name, placements in params.items():
        shape = shapes[name]
        tp_ways = mesh_shape[last] if placements[last] == Shard(0) else 1
        if shape and shape[0] % (dp_ways * tp_ways) == 0:
            params[name] = tuple(Shard(0) if a in dp_axes and mesh_shape[a] > 1 else p
                                 for a, p in enumerate(placements))
    return HandLayout(params, dp_axes)


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
    if ndim < 2:
        raise HandPlanError(f"hand-plan style 'tp_cp' puts Megatron on the last mesh axis and the sequence on the "
                            f"others: mesh {mesh_shape} has one axis; use cp or megatron")
    return HandLayout(tensor_parallel_params(model, mesh_shape, (ndim - 1,)), (), seq_axes=tuple(range(ndim - 1)),
                      head_axes=(ndim - 1,))


EXPERT_WEIGHT = re.compile(r"(^|\.)experts\.[^.]+$")


def ep(model: nn.Module, mesh_shape: tuple[int, ...]) -> HandLayout:
    last = len(mesh_shape) - 1
    params = fsdp(model, mesh_shape).params
    experts = [n for n, p in model.named_parameters(remove_duplicate=False) if p.ndim == 3 and EXPERT_WEIGHT.search(n)]
    if not experts:
        raise HandPlanError("hand-plan style 'ep' splits routed experts (three-dim parameters of an `experts` "
                            f"module), and model {type(model).__name__} has none; use data_parallel or fsdp")
    for n in experts:
        params[n] = _on((last,), Shard(0), mesh_shape)
    return HandLayout(params, _all_axes(mesh_shape), expert_axes=(last,))


STYLES: dict[str, Callable[[nn.Module, tuple[int, ...]], HandLayout]] = {
    "data_parallel": data_parallel, "megatron": megatron, "dp_tp": dp_tp, "fsdp": fsdp, "fsdp_tp": fsdp_tp,
    "cp": cp, "dp_cp": dp_cp, "fsdp_cp": fsdp_cp, "tp_cp": tp_cp, "ep": ep}
EXPERT_STYLES = ("ep",)  # styles of models with routed experts (a HandPlanError on others)
DENSE_STYLES = tuple(s for s in STYLES if s not in EXPERT_STYLES)


def _split(meta: TensorMeta, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
           uneven: bool = False) -> tuple:
    """`placements` where the tensor takes them (evenly, or with `uneven` in torch.chunk
    blocks on one axis leaving no rank empty), else replicated."""
    spec = Spec(canonical(placements, meta.shape, mesh_shape), meta)
    return spec.placements if spec.fits(mesh_shape, uneven=uneven) else (R,) * len(mesh_shape)


def _layout(dims: dict[int, tuple[int, ...]], ndim: int, mesh_shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """Tensor dim -> the mesh axes splitting it, as placements per mesh axis (dims the
    tensor lacks are dropped)."""
    out: list[Placement] = [R] * len(mesh_shape)
    for dim, axes in dims.items():
        for a in axes:
            if dim < ndim and mesh_shape[a] > 1:
                out[a] = Shard(dim)
    return tuple(out)


def sequence_length(traced) -> Optional[int]:
    """The inputs' sequence length: dim 1 of the first user input with two dims or more
    (the token ids), as passes/trace/dynamic.py marked_dims reads it."""
    return next((gi.meta.shape[1] for gi in traced.inputs if gi.kind == "user_input" and gi.meta.ndim >= 2), None)


def input_pins(traced, mesh_shape: tuple[int, ...], batch_axes: tuple[int, ...],
               seq_axes: tuple[int, ...] = (), style: str = "") -> dict[int, tuple]:
    """User input index -> placements: dim 0 split over `batch_axes` where it divides; with
    `seq_axes`, dim 1 of every input as long as the sequence split over them (unevenly
    where it must; a HandPlanError where it cannot: the style's point)."""
    length = sequence_length(traced) if seq_axes else None
    pins = {}
    for gi in traced.inputs:
        if gi.kind != "user_input":
            continue
        batch = _split(gi.meta, _layout({0: batch_axes}, gi.meta.ndim, mesh_shape), mesh_shape)
        pins[gi.target] = batch
        if length is None or gi.meta.ndim < 2 or gi.meta.shape[1] != length:
            continue
        label = traced.input_paths[gi.target] if gi.target < len(traced.input_paths) else gi.name
        both = _layout({0: tuple(a for a, p in enumerate(batch) if p != R), 1: seq_axes}, gi.meta.ndim, mesh_shape)
        pins[gi.target] = _sequence_split(gi.meta, both, label, mesh_shape, seq_axes, style)
    return pins


def _sequence_split(meta: TensorMeta, want: tuple[Placement, ...], label: str, mesh_shape: tuple[int, ...],
                    seq_axes: tuple[int, ...], style: str) -> tuple[Placement, ...]:
    if _split(meta, want, mesh_shape, uneven=True) == want:
        return want
    ways, n = prod(mesh_shape[a] for a in seq_axes), meta.shape[1]
    raise HandPlanError(
        f"hand-plan style {style!r} splits the sequence (dim 1) of input {label} ({n} positions) {ways} ways over "
        f"mesh axes {seq_axes}, which it cannot: an uneven split must be on one axis and leave no rank empty "
        f"(blocks of {-(-n // ways)}); use a length that divides {ways}, or a style that splits the sequence "
        "over one axis (dp_cp, tp_cp)")


def attention_pins(traced, mesh_shape: tuple[int, ...], layout: HandLayout, batch_split: bool
                   ) -> dict[OpOutput, tuple]:
    """Every attention's output [B, H, L, E] with its query rows split over the layout's
    sequence axes (context parallelism), its batch over the batch axes where the inputs'
    batch was split (`batch_split`) and its heads over the head axes where the key/value
    heads divide too (elsewhere the solver chooses: None)."""
    pins = {}
    for node in traced.gm.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        meta = TensorMeta.of(node.meta["val"])
        kv_heads = node.args[1].meta["val"].shape[1]
        heads = tuple(a for a in layout.head_axes if kv_heads % mesh_shape[a] == 0 and meta.shape[1] % mesh_shape[a] == 0)
        want: list[Optional[Placement]] = list(_layout({0: layout.batch_axes if batch_split else (), 1: heads,
                                                        2: layout.seq_axes}, meta.ndim, mesh_shape))
        for a in layout.head_axes:
            if a not in heads and mesh_shape[a] > 1:
                want[a] = None  # heads that do not divide: any layout there
        pins[OpOutput(node.name)] = tuple(want)
    return pins


def expert_pins(traced, mesh_shape: tuple[int, ...], layout: HandLayout) -> dict:
    """Every routed_experts node reads its experts split over the expert axes and splits
    its output by rows there and over the batch axes (so rows travel to their experts),
    where the rows divide."""
    pins: dict = {}
    for node in traced.gm.graph.nodes:
        if node.target is ROUTED_EXPERTS:
            meta = TensorMeta.of(node.meta["val"])
            axes = tuple(sorted(set(layout.batch_axes) | set(layout.expert_axes)))
            pins[OpOutput(node.name)] = _split(meta, _layout({0: axes}, meta.ndim, mesh_shape), mesh_shape)
            experts = node.args[2]
            for k, w in enumerate(experts):
                wmeta = TensorMeta.of(w.meta["val"])
                position = 1 + len(node.args[1]) + k  # tensor inputs: ids, row sources, experts
                pins[OpInput(node.name, position)] = tuple(
                    p if p != R else None for p in _split(wmeta, _layout({0: layout.expert_axes}, wmeta.ndim,
                                                                         mesh_shape), mesh_shape))
    return pins


def _check_sequence_axes(layout: HandLayout, mesh_shape: tuple[int, ...], style: str) -> None:
    if layout.seq_axes and prod(mesh_shape[a] for a in layout.seq_axes) == 1:
        raise HandPlanError(f"hand-plan style {style!r} splits the sequence over mesh axes {layout.seq_axes}, of size 1 "
                            f"on mesh {mesh_shape}: nothing to split; use a mesh whose sequence axes are larger, or "
                            "another style")


def hand_pins(model: nn.Module, traced, mesh_shape: tuple[int, ...], style: str) -> dict:
    """Parameter, user-input and attention layouts of `style` for the traced model (the
    `pinned` argument of autopar.passes.plan.planning.plan_traced)."""
    if style not in STYLES:
        raise HandPlanError(f"unknown hand-plan style {style!r}; choose one of {sorted(STYLES)}")
    return layout_pins(STYLES[style](model, mesh_shape), traced, mesh_shape, style)


def layout_pins(layout: HandLayout, traced, mesh_shape: tuple[int, ...], style: str) -> dict:
    """hand_pins of a layout already made: a pipelined hand plan makes its style's layout
    once and pins every stage's traced graph with it."""
    if not layout.seq_axes:
        return {**layout.params, **input_pins(traced, mesh_shape, layout.batch_axes),
                **(expert_pins(traced, mesh_shape, layout) if layout.expert_axes else {})}
    _check_sequence_axes(layout, mesh_shape, style)
    inputs = input_pins(traced, mesh_shape, layout.batch_axes, layout.seq_axes, style)
    batch_split = any(Shard(0) in p for p in inputs.values())
    return {**layout.params, **inputs, **attention_pins(traced, mesh_shape, layout, batch_split)}


def hand_plan(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, mesh: Any,
              style: str = "megatron", options: Optional[Options] = None, **option_overrides: Any):
    """The best complete Plan whose parameters and inputs are laid out as `style` prescribes.
    With Options.pipeline_axis (an axis number) the style holds inside every stage, on the
    mesh without that axis (torchtitan's FSDP x TP x PP: mesh (pp, dp, tp), pipeline_axis=0,
    style "fsdp_tp"); the stage split is the one autopar's own prices choose, so autopar's
    pipelined plan and this one differ only in the stages' layouts."""
    mesh_ = Mesh.of(mesh)
    if style not in STYLES:  # before tracing: a typo should not cost a trace
        raise HandPlanError(f"unknown hand-plan style {style!r}; choose one of {sorted(STYLES)}")
    opts = options_with(options, option_overrides)
    if opts.pipeline_axis is None:
        traced = trace_for_planning(model, args, kwargs, opts.param_dtype)
        return plan_traced(traced, mesh_, opts, hand_pins(model, traced, mesh_.shape, style))[1]
    if opts.pipeline_axis is PipelineAxis.AUTO:
        raise HandPlanError(f"a hand plan pipelines over the axis it is given: pipeline_axis='auto' chooses; give "
                            f"the axis number (mesh {mesh_.shape})")
    check_request(mesh_.shape, opts.pipeline_axis, opts.microbatches)
    sub = stage_mesh(mesh_, opts.pipeline_axis).shape
    try:  # before tracing: a style the stages' sub-mesh cannot take
        layout = STYLES[style](model, sub)
    except HandPlanError as e:
        raise HandPlanError(f"inside the pipeline stages, on mesh {mesh_.shape} without pipeline axis "
                            f"{opts.pipeline_axis}: {e}") from None
    return pipeline.plan_model(model, *planning_inputs(model, args, kwargs), mesh_, opts,
                               lambda traced: layout_pins(layout, traced, sub, style))
