"""Mixture-of-experts routing: the expert-indexed (grouped) matmul and the index_put that
undoes the sort by expert.

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
from autopar.passes.rules.registry import AxisRule, OpCall, register, register_name

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
