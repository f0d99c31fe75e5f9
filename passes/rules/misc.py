"""Tensor factories, scans, padding and gathers: mostly mask-building code that
depends on no parameter. Factories run replicated; scans and pads split the dims
they do not touch."""

from __future__ import annotations

import torch

from autopar.core.placement import R, Shard
from autopar.passes.rules._helpers import norm_dim
from autopar.passes.rules.registry import AxisRule, OpCall, register, replicate_rule

aten = torch.ops.aten

FACTORIES = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
    aten.zeros.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.tril.default, aten.triu.default, aten.index.Tensor, aten.scatter.src, aten.scatter.value,
    aten.index_select.default, aten.sort.default, aten.topk.default, aten.argmax.default,
}


@register(*FACTORIES)
def replicated(call: OpCall) -> list[AxisRule]:
    return replicate_rule(call)


def _all_but(call: OpCall, dim: int, inputs: int) -> list[AxisRule]:
    n = call.outputs[0].ndim
    rules = [AxisRule((R,) * len(call.inputs), (R,) * len(call.outputs))]
    for d in range(n):
        if d == dim:
            continue
        ins = tuple(Shard(d) if i < inputs and call.inputs[i].ndim == n else R for i in range(len(call.inputs)))
        rules.append(AxisRule(ins, (Shard(d),) * len(call.outputs)))
    return rules


@register(aten.cumsum.default, aten.cumprod.default)
def scan(call: OpCall) -> list[AxisRule]:
    return _all_but(call, norm_dim(call.args[1], call.inputs[0].ndim), len(call.inputs))


@register(aten.diff.default)
def diff(call: OpCall) -> list[AxisRule]:
    return _all_but(call, norm_dim(call.arg(2, "dim", -1), call.inputs[0].ndim), len(call.inputs))


@register(aten.gather.default)
def gather(call: OpCall) -> list[AxisRule]:
    x, index = call.inputs[0], call.inputs[1]
    dim = norm_dim(call.args[1], x.ndim)
    rules = [AxisRule((R, R), (R,))]
    for d in range(x.ndim):
        if d != dim and x.shape[d] == index.shape[d]:
            rules.append(AxisRule((Shard(d), Shard(d)), (Shard(d),)))
    return rules


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad(call: OpCall) -> list[AxisRule]:
    x = call.inputs[0]
    pads = list(call.args[1])
    touched = {x.ndim - 1 - i // 2 for i, p in enumerate(pads) if p != 0}
    rules = [AxisRule((R,), (R,))]
    rules += [AxisRule((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d not in touched]
    return rules
