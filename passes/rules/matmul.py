"""Matmul family, all derived from one einsum string per op."""

from __future__ import annotations

import string

import torch

from autopar.core.placement import R
from autopar.passes.rules._helpers import einsum_rules, with_bias
from autopar.passes.rules.registry import AxisRule, OpCall, register

aten = torch.ops.aten


@register(aten.mm.default)
def mm(call: OpCall) -> list[AxisRule]:
    return einsum_rules("mk,kn->mn")


@register(aten.bmm.default)
def bmm(call: OpCall) -> list[AxisRule]:
    return einsum_rules("bmk,bkn->bmn")


@register(aten.addmm.default)
def addmm(call: OpCall) -> list[AxisRule]:
    # addmm(bias, x, w) = bias + x @ w; scaled variants (beta/alpha) keep the algebra
    return with_bias(einsum_rules("mk,kn->mn"), call.inputs[0].ndim, 2, first=True)


@register(aten.baddbmm.default)
def baddbmm(call: OpCall) -> list[AxisRule]:
    return with_bias(einsum_rules("bmk,bkn->bmn"), call.inputs[0].ndim, 3, first=True)


def _batch_letters(n: int) -> str:
    return string.ascii_lowercase[:n]


@register(aten.linear.default)
def linear(call: OpCall) -> list[AxisRule]:
    # linear(x[..., k], w[n, k], b[n]) = x @ w.T + b
    x = call.inputs[0]
    lead = _batch_letters(x.ndim - 1).upper()
    rules = einsum_rules(f"{lead}K,NK->{lead}N")
    if len(call.inputs) == 3:
        rules = with_bias(rules, call.inputs[2].ndim, x.ndim, first=False)
    return rules


@register(aten.matmul.default)
def matmul(call: OpCall) -> list[AxisRule]:
    a, b = call.inputs
    if a.ndim < 2 or b.ndim < 2:
        return _replicated(call)
    batch = max(a.ndim, b.ndim) - 2
    letters = _batch_letters(batch).upper()
    ea = letters[batch - (a.ndim - 2):] + "MK"
    eb = letters[batch - (b.ndim - 2):] + "KN"
    # broadcast batch dims (size 1 on one side) cannot be sharded on that side
    rules = einsum_rules(f"{ea},{eb}->{letters}MN")
    return [r for r in rules if _respects_broadcast(r, call)]


def _respects_broadcast(rule: AxisRule, call: OpCall) -> bool:
    for placement, meta in zip(rule.inputs + rule.outputs, call.inputs + call.outputs):
        dim = getattr(placement, "dim", None)
        if dim is not None and meta.shape[dim] == 1:
            return False
    a, b = call.inputs
    out = call.outputs[0]
    for placement, meta in zip(rule.inputs, (a, b)):
        dim = getattr(placement, "dim", None)
        if dim is not None and dim < meta.ndim - 2:
            if meta.shape[dim] != out.shape[dim + out.ndim - meta.ndim]:
                return False
    return True


def _replicated(call: OpCall) -> list[AxisRule]:
    return [AxisRule((R,) * len(call.inputs), (R,))]
