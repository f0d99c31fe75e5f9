"""Convolutions, pooling and batch/group norm: the CNN family, in NC(D)HW layout.

    conv       batch split (weights whole); output channels (weight dim 0, bias with
               them); input channels (weight dim 1) as a partial sum, groups=1 only -
               with groups each group's channels must stay on one rank
    pooling    batch and channel splits; average pools are linear (P passes through)
    batch_norm batch and spatial splits in inference (running statistics); channel split always
               (per-channel statistics and affine parameters split with the channels)
    group_norm batch split (a group's statistics span its channels and all positions)
"""

from __future__ import annotations

import torch

from autopar.core.placement import P, Partial, Placement, R, Shard
from autopar.passes.rules.registry import AxisRule, OpCall, register

aten = torch.ops.aten


@register(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
def conv(call: OpCall) -> list[AxisRule]:
    has_bias = len(call.inputs) == 3
    groups = call.arg(6, "groups", 1)

    def rule(x: Placement, w: Placement, b: Placement, out: Placement) -> AxisRule:
        return AxisRule((x, w, b) if has_bias else (x, w), (out,))

    rules = [rule(R, R, R, R), rule(Shard(0), R, R, Shard(0))]
    if groups == 1:
        rules += [rule(R, Shard(0), Shard(0), Shard(1)),  # output channels
                  rule(Shard(1), Shard(1), P, P)]  # input channels: partial sums (bias added once)
    if call.inputs[0].dtype.is_floating_point:
        rules += [rule(P, R, P, P), rule(R, P, P, P)]  # bilinear in input and weight; bias rides along
    return rules


@register(aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
          aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default,
          aten.max_pool2d_with_indices.default)
def max_pool(call: OpCall) -> list[AxisRule]:
    return _per_channel(call, linear=False)


@register(aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
          aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default)
def avg_pool(call: OpCall) -> list[AxisRule]:
    return _per_channel(call, linear=call.inputs[0].dtype.is_floating_point)


def _per_channel(call: OpCall, linear: bool) -> list[AxisRule]:
    """Leading (batch, channel) dims of a pooled input: 2 of them batched, 1 unbatched."""
    x = call.inputs[0]
    spatial = {aten.max_pool1d.default: 1, aten.adaptive_max_pool1d.default: 1, aten.avg_pool1d.default: 1,
               aten.adaptive_avg_pool1d.default: 1, aten.max_pool3d.default: 3, aten.adaptive_max_pool3d.default: 3,
               aten.avg_pool3d.default: 3, aten.adaptive_avg_pool3d.default: 3}.get(call.target, 2)
    lead = x.ndim - spatial
    n_out = len(call.outputs)
    rules = [AxisRule((R,), (R,) * n_out)]
    rules += [AxisRule((Shard(d),), (Shard(d),) * n_out) for d in range(lead)]
    if linear:
        rules += [AxisRule((Partial(k),), (Partial(k),)) for k in ("sum", "avg")]
    return rules


@register(aten.batch_norm.default)
def batch_norm(call: OpCall) -> list[AxisRule]:
    # batch_norm(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps, cudnn)
    n_params = len(call.inputs) - 1
    training = call.arg(5, "training", False)
    rules = [AxisRule((R,) * len(call.inputs), (R,))]
    if call.inputs[0].ndim > 1:
        rules.append(AxisRule((Shard(1),) + (Shard(0),) * n_params, (Shard(1),)))
    if not training:  # inference normalises with fixed statistics: every position is independent
        rules += [AxisRule((Shard(d),) + (R,) * n_params, (Shard(d),)) for d in range(call.inputs[0].ndim) if d != 1]
    return rules


@register(aten.group_norm.default)
def group_norm(call: OpCall) -> list[AxisRule]:
    n_params = len(call.inputs) - 1
    return [AxisRule((R,) * len(call.inputs), (R,)), AxisRule((Shard(0),) + (R,) * n_params, (Shard(0),))]
