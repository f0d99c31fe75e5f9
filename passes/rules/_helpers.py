"""Shared builders for rule families (dim normalisation, broadcasting, einsum)."""

from __future__ import annotations

from autopar.core.placement import P, Partial, Placement, R, Shard
from autopar.passes.rules.registry import AxisRule, OpCall


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def broadcast_rules(call: OpCall, linear_in: tuple[int, ...] = (), partial: tuple[str, ...] = ()) -> list[AxisRule]:
    """Elementwise op with numpy broadcasting: shard any output dim on every input that
    really has it (size > 1); inputs broadcast along it stay R.

    `linear_in`: inputs in which the op is linear while the others are fixed; each may
    be P while the others are R (or P together, for sums: pass them all). `partial`
    lists the reduce kinds that pass through.
    """
    out = call.outputs[0]
    rules = [AxisRule((R,) * len(call.inputs), (R,) * len(call.outputs))]
    for d in range(out.ndim):
        if out.shape[d] == 1:
            continue
        ins: list[Placement] = []
        for m in call.inputs:
            k = d - (out.ndim - m.ndim)
            ins.append(Shard(k) if k >= 0 and m.shape[k] == out.shape[d] else R)
        rules.append(AxisRule(tuple(ins), (Shard(d),) * len(call.outputs)))
    for kind in partial:
        if linear_in:
            rules.append(AxisRule(tuple(Partial(kind) if i in linear_in else R for i in range(len(call.inputs))),
                                  (Partial(kind),) * len(call.outputs)))
    return rules


def einsum_rules(equation: str, n_extra_inputs: int = 0) -> list[AxisRule]:
    """Rules of a two-operand einsum 'mk,kn->mn': a letter in both operands and the
    output is a batch dim (shard all three), in one operand and the output is a free
    dim (shard it, the other operand R), in both operands only is contracted (shard
    both, output P). Each operand may also be P alone (bilinearity)."""
    lhs, out = equation.split("->")
    a, b = lhs.split(",")
    rules = [AxisRule((R, R), (R,)), AxisRule((P, R), (P,)), AxisRule((R, P), (P,))]
    for ch in dict.fromkeys(a + b):
        pa = Shard(a.index(ch)) if ch in a else R
        pb = Shard(b.index(ch)) if ch in b else R
        po = Shard(out.index(ch)) if ch in out else P
        rules.append(AxisRule((pa, pb), (po,)))
    return rules


def with_bias(rules: list[AxisRule], bias_ndim: int, out_ndim: int, first: bool) -> list[AxisRule]:
    """Add a bias input (broadcast against the output) to matmul rules: the bias follows
    the output placement where it has that dim, is R where it broadcasts, P with P."""
    out = []
    for r in rules:
        po = r.outputs[0]
        if isinstance(po, Partial):
            pb: Placement = po
        elif isinstance(po, Shard):
            k = po.dim - (out_ndim - bias_ndim)
            pb = Shard(k) if k >= 0 else R
        else:
            pb = R
        out.append(AxisRule((pb,) + r.inputs if first else r.inputs + (pb,), r.outputs))
    return out


def dim_map_rules(call: OpCall, mapping: dict[int, int], linear: bool = True) -> list[AxisRule]:
    """Single-input ops that move dims: input dim i sharded -> output dim mapping[i]."""
    rules = [AxisRule((R,), (R,) * len(call.outputs))]
    for i, o in mapping.items():
        rules.append(AxisRule((Shard(i),), (Shard(o),) * len(call.outputs)))
    if linear and call.inputs[0].dtype.is_floating_point:
        rules.append(AxisRule((P,), (P,) * len(call.outputs)))
        rules.append(AxisRule((Partial("avg"),), (Partial("avg"),) * len(call.outputs)))
    return rules
