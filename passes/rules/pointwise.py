"""Elementwise ops. Sharding passes through any dim that is not broadcast; Partial
passes through only where the op is linear in that input (the algebra is beside each
table)."""

from __future__ import annotations

import torch

from autopar.passes.rules._helpers import broadcast_rules
from autopar.passes.rules.registry import AxisRule, OpCall, register

aten = torch.ops.aten

# f(a + b) = f(a) + f(b): a sum-partial (and an average) passes through.
LINEAR_UNARY = {
    aten.neg.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.positive.default,
}
# casts are linear on floats only (an int cast of a summand is not a summand of the cast)
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default}
NONLINEAR_UNARY = {
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.sin.default,
    aten.cos.default, aten.abs.default, aten.pow.Tensor_Scalar, aten.erf.default, aten.reciprocal.default,
    aten.logical_not.default, aten.bitwise_not.default, aten.ne.Scalar, aten.eq.Scalar, aten.ge.Scalar,
    aten.gt.Scalar, aten.le.Scalar, aten.lt.Scalar, aten.clamp.default, aten.square.default,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
    aten.leaky_relu.default, aten.hardtanh.default, aten.mish.default, aten.softplus.default,
    aten.log1p.default, aten.expm1.default, aten.floor.default, aten.ceil.default, aten.round.default,
    aten.sign.default, aten.isnan.default, aten.isinf.default, aten.masked_fill.Scalar,
    aten.relu_.default, aten.gelu_.default, aten.silu_.default,
}
# a + b, a - b: sum-partials of both operands add up
ADDITIVE = {aten.add.Tensor, aten.sub.Tensor}
# a * b: linear in each operand while the other is fixed
MULTIPLICATIVE = {aten.mul.Tensor}
# a / b: linear in a only
DIVISION = {aten.div.Tensor}
NONLINEAR_BINARY = {
    aten.eq.Tensor, aten.ne.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.maximum.default, aten.minimum.default,
    aten.pow.Tensor_Tensor, aten.masked_fill.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar,
    aten.rsub.Tensor, aten.atan2.default, aten.remainder.Tensor, aten.floor_divide.default,
    aten.min.other, aten.max.other,
    # functional forms of in-place writes (passes/trace/trace.py): the result is `src` / `value`
    # broadcast to self's shape
    aten.copy.default, aten.fill.Tensor,
}


def _float(call: OpCall) -> bool:
    return all(m.dtype.is_floating_point for m in call.inputs + call.outputs)


def _dropout_is_identity(call: OpCall) -> bool:
    return call.arg(1, "p", 0.0) == 0.0 or call.arg(2, "train", True) is False


@register(*LINEAR_UNARY, *CASTS)
def linear_unary(call: OpCall) -> list[AxisRule]:
    linear = (0,) if _float(call) else ()
    return broadcast_rules(call, linear_in=linear, partial=("sum", "avg"))


@register(*NONLINEAR_UNARY, *NONLINEAR_BINARY)
def nonlinear(call: OpCall) -> list[AxisRule]:
    return broadcast_rules(call)


@register(aten.dropout.default, aten.native_dropout.default)
def dropout(call: OpCall) -> list[AxisRule]:
    # with p > 0 in training each rank draws its own mask; a summand's mask would differ
    # from the sum's, so Partial passes only when dropout is the identity
    linear = (0,) if _dropout_is_identity(call) and _float(call) else ()
    return broadcast_rules(call, linear_in=linear, partial=("sum", "avg"))


@register(*ADDITIVE)
def additive(call: OpCall) -> list[AxisRule]:
    # a + scalar is not linear (the scalar would be added once per summand)
    if len(call.inputs) < 2 or not _float(call) or any(m.ndim == 0 for m in call.inputs):
        return broadcast_rules(call)
    return broadcast_rules(call, linear_in=(0, 1), partial=("sum", "avg"))


@register(*MULTIPLICATIVE)
def multiplicative(call: OpCall) -> list[AxisRule]:
    rules = broadcast_rules(call)
    if not _float(call):
        return rules
    for i in range(len(call.inputs)):
        rules += broadcast_rules(call, linear_in=(i,), partial=("sum", "avg"))[-2:]
    return rules


@register(*DIVISION)
def division(call: OpCall) -> list[AxisRule]:
    rules = broadcast_rules(call)
    if _float(call):
        rules += broadcast_rules(call, linear_in=(0,), partial=("sum", "avg"))[-2:]
    return rules


@register(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)
def where(call: OpCall) -> list[AxisRule]:
    return broadcast_rules(call)
