"""Neural-network ops kept whole by torch.export: softmax, norms, attention,
embedding, losses."""

from __future__ import annotations

import torch

from autopar.core.kinds import LossReduction
from autopar.core.placement import P, Placement, R, Shard
from autopar.passes.rules._helpers import norm_dim
from autopar.passes.rules.registry import AxisRule, OpCall, register

aten = torch.ops.aten


@register(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def softmax(call: OpCall) -> list[AxisRule]:
    x = call.inputs[0]
    dim = norm_dim(call.args[1], x.ndim)
    return [AxisRule((R,), (R,))] + [AxisRule((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@register(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(call: OpCall) -> list[AxisRule]:
    # layer_norm / rms_norm(x, normalized_shape, weight?, ...): statistics over the last dims
    x = call.inputs[0]
    k = len(call.args[1])
    extra = (R,) * (len(call.inputs) - 1)
    rules = [AxisRule((R,) + extra, (R,))]
    rules += [AxisRule((Shard(d),) + extra, (Shard(d),)) for d in range(x.ndim - k)]
    return rules


@register(aten._weight_norm.default)
def weight_norm(call: OpCall) -> list[AxisRule]:
    # _weight_norm(v, g, dim) = v * g / ||v||, the norm over every dim but `dim` (g has
    # size 1 there): each slice along `dim` is normalised alone, so v and g split along it
    # together; any other split of v would cut the norm's sum. dim -1 is the whole tensor.
    # (A hand rule, not discovery: the kernel does not check that v and g agree, and a
    # mismatched trial split corrupts the heap instead of raising.)
    v = call.inputs[0]
    dim = call.arg(2, "dim", 0)
    rules = [AxisRule((R, R), (R,))]
    if dim != -1:
        d = norm_dim(dim, v.ndim)
        rules.append(AxisRule((Shard(d), Shard(d)), (Shard(d),)))
    return rules


@register(aten.native_layer_norm.default)
def native_layer_norm(call: OpCall) -> list[AxisRule]:
    x = call.inputs[0]
    k = len(call.args[1])
    extra = (R,) * (len(call.inputs) - 1)
    rules = [AxisRule((R,) + extra, (R, R, R))]
    rules += [AxisRule((Shard(d),) + extra, (Shard(d),) * 3) for d in range(x.ndim - k)]
    return rules


def _mask_placement(mask_shape: tuple[int, ...], out_dim: int, out_ndim: int) -> Placement:
    k = out_dim - (out_ndim - len(mask_shape))
    return Shard(k) if k >= 0 and mask_shape[k] > 1 else R


@register(aten.scaled_dot_product_attention.default)
def sdpa(call: OpCall) -> list[AxisRule]:
    """sdpa(q[B,H,L,E], k[B,Hk,S,E], v[B,Hk,S,Ev], mask?): batch and heads split
    freely (GQA keeps its q-to-kv head ratio per chunk); query rows split with k and v
    whole (context parallelism by gathered keys and values): an explicit mask splits
    with the rows, and a causal one (is_causal, as many queries as keys) becomes each
    block's own offset mask (passes/rules/local.py causal_rows_attention)."""
    q = call.inputs[0]
    has_mask = len(call.inputs) == 4
    mask = call.inputs[3].shape if has_mask else ()

    def rule(qp: Placement, kvp: Placement, dim: int) -> AxisRule:
        ins: tuple[Placement, ...] = (qp, kvp, kvp)
        if has_mask:
            ins += (_mask_placement(mask, dim, q.ndim) if isinstance(qp, Shard) else R,)
        return AxisRule(ins, (qp,))

    rules = [AxisRule((R,) * len(call.inputs), (R,))]
    rules.append(rule(Shard(0), Shard(0), 0))
    rules.append(rule(Shard(1), Shard(1), 1))
    # a causal block's mask starts where its rows do, worked out from the keys' length
    # when it runs (passes/rules/local.py): causal rows split only in self-attention
    if not call.arg(5, "is_causal", False) or q.shape[2] == call.inputs[1].shape[2]:
        rules.append(rule(Shard(2), R, 2))
    return rules


@register(aten.embedding.default)
def embedding(call: OpCall) -> list[AxisRule]:
    # embedding(weight[V, H], indices[...]) -> [..., H]
    weight, idx = call.inputs
    out_last = call.outputs[0].ndim - 1
    rules = [AxisRule((R, R), (R,)), AxisRule((Shard(1), R), (Shard(out_last),))]
    rules += [AxisRule((R, Shard(d)), (Shard(d),)) for d in range(idx.ndim)]
    if weight.dtype.is_floating_point:  # vocabulary split: each rank looks up its rows (passes/rules/local.py)
        rules.append(AxisRule((Shard(0), R), (P,)))
    return rules


@register(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
def cross_entropy(call: OpCall) -> list[AxisRule]:
    """(input[N, C, ...], target[N, ...], weight?) over rows. 'none' keeps rows split,
    'sum' leaves P; 'mean' divides by the count of non-ignored targets, which differs
    per chunk, so it runs replicated."""
    reduction = call.arg(3, "reduction", LossReduction.MEAN)
    extra = (R,) * (len(call.inputs) - 2)
    rules = [AxisRule((R,) * len(call.inputs), (R,))]
    if call.inputs[0].ndim >= 2:
        if reduction == LossReduction.NONE:
            rules.append(AxisRule((Shard(0), Shard(0)) + extra, (Shard(0),)))
        elif reduction == LossReduction.SUM:
            rules.append(AxisRule((Shard(0), Shard(0)) + extra, (P,)))
    return rules

