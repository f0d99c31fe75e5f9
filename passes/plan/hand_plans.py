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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Optional

from torch import nn

from autopar.core.mesh import Mesh
from autopar.core.placement import Placement, R, Shard
from autopar.passes.plan.planning import options_with, plan_traced, trace_for_planning

ROW_PARALLEL = re.compile(r"(o_proj|down_proj|c_proj|out_proj|fc2|dense_4h_to_h|attention\.output\.dense|"
                          r"\.output\.dense|wo|w2)$")


@dataclass(frozen=True)
class HandLayout:
    params: dict[str, tuple[Placement, ...]]  # state-dict key -> placements per mesh axis
    batch_axes: tuple[int, ...]  # mesh axes the inputs' dim 0 is split over


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
    all_axes = tuple(range(ndim))
    params = {n: _on(all_axes, Shard(0), mesh_shape) if p.ndim and p.shape[0] % ways == 0 else (R,) * ndim
              for n, p in model.named_parameters(remove_duplicate=False)}
    return HandLayout(params, all_axes)


STYLES: dict[str, Callable[[nn.Module, tuple[int, ...]], HandLayout]] = {
    "data_parallel": data_parallel, "megatron": megatron, "dp_tp": dp_tp, "fsdp": fsdp}


def input_pins(traced, mesh_shape: tuple[int, ...], batch_axes: tuple[int, ...]) -> dict[int, tuple]:
    """User input index -> placements: dim 0 split over `batch_axes` where it divides."""
    ways = prod(mesh_shape[a] for a in batch_axes)
    pins = {}
    for gi in traced.inputs:
        if gi.kind == "user_input":
            split = batch_axes and gi.meta.ndim and gi.meta.shape[0] % ways == 0
            pins[gi.target] = _on(batch_axes if split else (), Shard(0), mesh_shape)
    return pins


def hand_pins(model: nn.Module, traced, mesh_shape: tuple[int, ...], style: str) -> dict:
    """Parameter and user-input layouts of `style` for the traced model (the `pinned`
    argument of autopar.passes.plan.planning.plan_traced)."""
    if style not in STYLES:
        raise ValueError(f"unknown hand-plan style {style!r}; choose one of {sorted(STYLES)}")
    layout = STYLES[style](model, mesh_shape)
    return {**layout.params, **input_pins(traced, mesh_shape, layout.batch_axes)}


def hand_plan(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, mesh: Any,
              style: str = "megatron", **option_overrides: Any):
    """The best complete Plan whose parameters and inputs are laid out as `style` prescribes."""
    mesh_ = Mesh.of(mesh)
    if style not in STYLES:  # before tracing: a typo should not cost a trace
        raise ValueError(f"unknown hand-plan style {style!r}; choose one of {sorted(STYLES)}")
    traced = trace_for_planning(model, args, kwargs)
    return plan_traced(traced, mesh_, options_with(None, option_overrides), hand_pins(model, traced, mesh_.shape, style))[1]
