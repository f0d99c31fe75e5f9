"""Plans that experts write by hand, as parameter layouts for the same solver.

A hand plan fixes where every parameter lives; the solver then fills in the cheapest
activation layouts consistent with it, so the result is a complete, runnable Plan
priced by the same cost model as autopar's own (which can only be cheaper or equal,
since it may also choose the parameter layouts).

    megatron      column-parallel layers (q/k/v, gate/up, c_attn, c_fc, intermediate)
                  split their output dim, row-parallel layers (o_proj, down_proj,
                  c_proj, output.dense) their input dim, on the tensor-parallel axis;
                  the LM head splits the vocabulary; norms and embeddings replicated
    data_parallel every parameter replicated
"""

from __future__ import annotations

import re
from typing import Any, Optional

from torch import nn

from autopar.placement import R, Shard

ROW_PARALLEL = re.compile(r"(o_proj|down_proj|c_proj|out_proj|fc2|dense_4h_to_h|attention\.output\.dense|"
                          r"\.output\.dense|wo|w2)$")
VOCAB_HEADS = re.compile(r"(lm_head|cls\.predictions\.decoder)$")


def _kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.Linear):
        return "linear"  # weight [out, in]
    if type(module).__name__ == "Conv1D":
        return "conv1d"  # transformers' GPT-2 layer: weight [in, out]
    return None


def megatron(model: nn.Module, mesh_shape: tuple[int, ...], tp_axis: int = -1) -> dict[str, tuple]:
    """Parameter name -> placements for Megatron tensor parallelism on `tp_axis`."""
    ndim = len(mesh_shape)
    tp_axis %= ndim
    pins: dict[str, tuple] = {}

    def on_tp(p) -> tuple:
        out = [R] * ndim
        out[tp_axis] = p
        return tuple(out)

    for name, module in model.named_modules():
        kind = _kind(module)
        for pname, param in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            pins[full] = (R,) * ndim
            if kind is None:
                continue
            row = bool(ROW_PARALLEL.search(name))
            out_dim, in_dim = (0, 1) if kind == "linear" else (1, 0)
            if pname == "weight":
                dim = in_dim if row else out_dim
                if param.shape[dim] % mesh_shape[tp_axis] == 0:
                    pins[full] = on_tp(Shard(dim))
            elif pname == "bias" and not row and param.shape[0] % mesh_shape[tp_axis] == 0:
                pins[full] = on_tp(Shard(0))
    return pins


def data_parallel(model: nn.Module, mesh_shape: tuple[int, ...]) -> dict[str, tuple]:
    return {name: (R,) * len(mesh_shape) for name, _ in model.named_parameters(remove_duplicate=False)}


STYLES = {"megatron": megatron, "data_parallel": data_parallel}


def hand_plan(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, mesh: Any,
              style: str = "megatron", **option_overrides: Any):
    """The best complete Plan whose parameters are laid out as `style` prescribes."""
    from autopar.mesh import Mesh
    from autopar.planning import _options, plan_traced
    from autopar.passes.trace import trace
    if style not in STYLES:
        raise ValueError(f"unknown hand-plan style {style!r}; choose one of {sorted(STYLES)}")
    mesh_ = Mesh.of(mesh)
    pins = STYLES[style](model, mesh_.shape)
    traced = trace(model, tuple(args), kwargs)
    return plan_traced(traced, mesh_, _options(None, option_overrides), pins)[1]
