"""Mixture-of-experts routing: the routed experts op, the expert-indexed (grouped) matmul
and the index_put that undoes the sort by expert.

    routed       routed_experts(ids[S], rows, experts[E, ...]) (autopar/core/routed.py):
    experts      each routed row is computed alone by its expert, so on one axis
                 rows     ids and rows split, experts whole      -> rows split
                 experts  ids and rows split, experts split      -> rows split (each row
                          sent to its expert's rank and back: expert parallelism)
                 masked   ids and rows whole, experts split      -> partial sum (each rank
                          its experts' rows, zeros elsewhere)
                 Experts are split on at most one axis (the all-to-all and the mask
                 serve one axis's group).

    grouped mm   out[M, N] = x[M, K] @ w[e(m), K, N], rows grouped by expert through
                 cumulative offsets. Rows cannot be split (the offsets are global) and
                 experts cannot without an all-to-all of tokens, but each expert's
                 matmul can be cut like any matmul: N (weight dim 2, output dim 1), K
                 (x dim 1 and weight dim 1, partial output), or one operand partial.
    index_put    self[idx] = values along dim 0: any trailing dim splits self, values
                 and the output alike (the indices stay whole).
"""

from __future__ import annotations

import torch

from autopar.core.placement import P, R, Shard
from autopar.core.routed import ROUTED_EXPERTS
from autopar.passes.rules.registry import AxisRule, OpCall, Strategy, register, register_check, register_name

aten = torch.ops.aten


def grouped_mm(call: OpCall) -> list[AxisRule]:
    extra = (R,) * (len(call.inputs) - 2)  # offsets (and bias, if any) stay whole
    x, w = call.inputs[0], call.inputs[1]
    if x.ndim != 2 or w.ndim != 3:  # the batched (3-D x) form: only replication is offered
        return [AxisRule((R,) * len(call.inputs), (R,))]
    return [AxisRule((R, R) + extra, (R,)),
            AxisRule((R, Shard(2)) + extra, (Shard(1),)),
            AxisRule((Shard(1), Shard(1)) + extra, (P,)),
            AxisRule((P, R) + extra, (P,)),
            AxisRule((R, P) + extra, (P,))]


register(aten._grouped_mm.default)(grouped_mm)
# transformers' fallback for devices without torch._grouped_mm (same contract); it
# exists only once transformers is imported, so it is registered by name
register_name("transformers.grouped_mm_fallback.default")(grouped_mm)


@register(aten.index_put.default)
def index_put(call: OpCall) -> list[AxisRule]:
    indices = call.arg(1, "indices", [])
    n_idx = len(call.inputs) - 2  # self, the index tensors, values
    self_, values = call.inputs[0], call.inputs[-1]
    rules = [AxisRule((R,) * len(call.inputs), (R,))]
    if len(indices) != 1 or call.arg(3, "accumulate", False):
        return rules
    for d in range(1, self_.ndim):
        k = d - (self_.ndim - values.ndim)
        if k < 0 or values.shape[k] != self_.shape[d]:
            continue
        rules.append(AxisRule((Shard(d),) + (R,) * n_idx + (Shard(k),), (Shard(d),)))
    return rules


@register(ROUTED_EXPERTS)
def routed_experts(call: OpCall) -> list[AxisRule]:
    rows = (R,) * len(call.arg(1, "rows"))
    experts = len(call.arg(2, "experts"))
    split_rows = (Shard(0),) * (1 + len(rows))
    return [AxisRule((R,) + rows + (R,) * experts, (R,)),
            AxisRule(split_rows + (R,) * experts, (Shard(0),)),
            AxisRule(split_rows + (Shard(0),) * experts, (Shard(0),)),
            AxisRule((R,) + rows + (Shard(0),) * experts, (P,))]


@register_check(ROUTED_EXPERTS)
def experts_split_once(strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
    return len(strategy.inputs[-1].shard_axes(0)) <= 1
