"""Reductions. A reduced dim that is sharded leaves a partial: sum -> P, mean ->
P(avg) (equal chunks, so the mean of local means is the mean), amax -> P(max). Dims
that survive keep their shard. sum and mean are linear, so P(sum)/P(avg) pass through."""

from __future__ import annotations

import torch

from autopar.core.placement import Partial, R, Shard
from autopar.passes.rules._helpers import norm_dim
from autopar.passes.rules.registry import AxisRule, OpCall, register

aten = torch.ops.aten

REDUCE_KIND = {
    aten.sum.dim_IntList: "sum", aten.sum.default: "sum",
    aten.mean.dim: "avg", aten.mean.default: "avg",
    aten.amax.default: "max", aten.max.default: "max",
}
LINEAR_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}


def _reduced_dims(call: OpCall) -> tuple[list[int], bool]:
    x = call.inputs[0]
    if call.target in (aten.sum.default, aten.mean.default, aten.max.default):
        return list(range(x.ndim)), False
    dims = call.arg(1, "dim", None)
    if dims is None or dims == []:
        dims = list(range(x.ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(norm_dim(d, x.ndim) for d in dims), bool(call.arg(2, "keepdim", False))


@register(*REDUCE_KIND)
def reduction(call: OpCall) -> list[AxisRule]:
    x = call.inputs[0]
    kind = REDUCE_KIND[call.target]
    reduced, keepdim = _reduced_dims(call)
    rules = [AxisRule((R,), (R,))]
    out_dim = 0
    for d in range(x.ndim):
        if d in reduced:
            if x.shape[d] > 1:
                rules.append(AxisRule((Shard(d),), (Partial(kind),)))
            out_dim += keepdim
            continue
        rules.append(AxisRule((Shard(d),), (Shard(out_dim),)))
        out_dim += 1
    if call.target in LINEAR_REDUCTIONS and x.dtype.is_floating_point:
        rules += [AxisRule((Partial("sum"),), (Partial("sum"),)), AxisRule((Partial("avg"),), (Partial("avg"),))]
    return rules
