"""The per-op rule registry.

A rule is a small pure function of one op call that lists how the op may run on ONE
mesh axis: a placement for each tensor input and each tensor output. `expand` takes
the product over the mesh axes and keeps the combinations whose shards divide evenly,
or, asked to, also those with uneven shards (torch.chunk blocks, autopar/core/placement.py)
where that is still exact: on an axis with a short last block every sharded dim of the
op has the same size (so every tensor is cut at the same places: an elementwise op, a
matmul's batch, free or contracted dim, a view that keeps the dim whole; not a view
that merges it with another, whose chunks fall elsewhere) and no output is an average
(a mean of unequal blocks' means is not the mean).

Units (Shard.unit: a dim cut between whole heads, autopar/core/placement.py): with `units`
(dim size -> head sizes, passes/strategies/strategies.py head_units), an axis whose heads do not
divide it also gets each rule again with its shards in whole heads, where every shard of
the rule is of one size (the op cuts them all at the same places: a matmul's letter, an
elementwise dim). A view states its own (passes/rules/views.py: 320 in heads of 64 is
5 heads). Exact means the sharded dims have one number of units, not one size.

    @register(aten.mm.default)
    def mm(call: OpCall) -> list[AxisRule]:
        return einsum_rules("mk,kn->mn", call)
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from autopar.core.placement import Partial, Placement, R, Shard, Spec, TensorMeta, canonical, units_of


@dataclass(frozen=True)
class TensorArg:
    """Stands for the i-th tensor input inside OpCall.args (the graph node is elsewhere)."""

    index: int


CAUSAL_TARGET = torch.ops.aten.scaled_dot_product_attention.default


@dataclass(frozen=True)
class OpCall:
    """What a rule may look at: the op, its arguments with tensors replaced by
    TensorArg markers, and the metas of its tensor inputs and outputs."""

    target: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    @property
    def causal(self) -> bool:
        """sdpa with is_causal, which the cost model prices as its kernel runs
        (cost_models/attention.py)."""
        return self.target is CAUSAL_TARGET and bool(self.arg(5, "is_causal", False))


@dataclass(frozen=True)
class AxisRule:
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the whole mesh: the spec each tensor input must be in
    and the spec of each tensor output."""

    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]

    def __str__(self) -> str:
        ins = ",".join(str(s) for s in self.inputs)
        outs = ",".join(str(s) for s in self.outputs)
        return f"({ins})->{outs}"


RuleFn = Callable[[OpCall], list[AxisRule]]
# whether a combination of per-axis rules is one the op's local form can run (most ops: all)
CheckFn = Callable[["Strategy", tuple[int, ...]], bool]
_RULES: dict[Any, RuleFn] = {}
_CHECKS: dict[Any, CheckFn] = {}
_RULES_BY_NAME: dict[str, RuleFn] = {}  # ops of libraries that register them at import (transformers::...)


def register(*targets: Any) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            _RULES[t] = fn
        return fn
    return deco


def register_name(*names: str) -> Callable[[RuleFn], RuleFn]:
    """Register by the op's qualified overload name ('transformers.grouped_mm_fallback.default'),
    for ops that may not exist when autopar is imported."""
    def deco(fn: RuleFn) -> RuleFn:
        for n in names:
            _RULES_BY_NAME[n] = fn
        return fn
    return deco


def register_check(*targets: Any) -> Callable[[CheckFn], CheckFn]:
    """A test each expanded strategy of these ops must pass (an op whose local form serves
    some per-axis rules on one axis at a time, not on several at once)."""
    def deco(fn: CheckFn) -> CheckFn:
        for t in targets:
            _CHECKS[t] = fn
        return fn
    return deco


def rule_for(target: Any) -> Optional[RuleFn]:
    return _RULES.get(target) or _RULES_BY_NAME.get(str(target))


def registered_targets() -> frozenset:
    return frozenset(_RULES) | frozenset(_RULES_BY_NAME)


def replicate_rule(call: OpCall) -> list[AxisRule]:
    return [AxisRule((R,) * len(call.inputs), (R,) * len(call.outputs))]


def expand(rules: Iterable[AxisRule], call: OpCall, mesh_shape: tuple[int, ...], uneven: bool = False,
           units: Optional[Mapping[int, tuple[int, ...]]] = None) -> list[Strategy]:
    """Product of per-axis rules over the mesh; keeps first-seen order. Drops uneven
    shards unless `uneven`, and then keeps only those `uneven_exact` allows; `units`
    adds whole-head variants where heads do not divide an axis (module docstring)."""
    rules = list(dict.fromkeys(rules))
    replicated = [r for r in rules if all(p == R for p in r.inputs + r.outputs)] or rules
    # a mesh axis of size 1 holds everything whole: R is the only distinct layout there
    per_axis = [(rules + unit_variants(rules, call, n, units or {}) if uneven else rules) if n > 1 else replicated
                for n in mesh_shape]
    out: dict[Strategy, None] = {}
    check = _CHECKS.get(call.target)
    for combo in product(*per_axis):
        ins = tuple(_spec(tuple(r.inputs[i] for r in combo), m, mesh_shape) for i, m in enumerate(call.inputs))
        outs = tuple(_spec(tuple(r.outputs[i] for r in combo), m, mesh_shape) for i, m in enumerate(call.outputs))
        if all(s.fits(mesh_shape) for s in ins + outs) or (
                uneven and all(s.fits(mesh_shape, uneven=True) for s in ins + outs)
                and uneven_exact(ins + outs, mesh_shape)):
            if check is None or check(Strategy(ins, outs), mesh_shape):
                out[Strategy(ins, outs)] = None
    return list(out)


def _spec(placements: tuple[Placement, ...], meta: TensorMeta, mesh_shape: tuple[int, ...]) -> Spec:
    return Spec(canonical(placements, meta.shape, mesh_shape), meta)


def unit_variants(rules: list[AxisRule], call: OpCall, k: int, units: Mapping[int, tuple[int, ...]]
                  ) -> list[AxisRule]:
    """Each rule again with its shards cut in whole heads of u, for every head size u of
    their (one) dim size n whose n / u heads do not divide the axis size k."""
    out = []
    for r in rules:
        sizes = {m.shape[p.dim] for p, m in zip(r.inputs + r.outputs, call.inputs + call.outputs)
                 if type(p) is Shard and p.unit == 1 and p.dim < m.ndim}
        if len(sizes) != 1 or any(type(p) is Shard and p.unit != 1 for p in r.inputs + r.outputs):
            continue
        n = sizes.pop()
        for u in units.get(n, ()):
            if (n // u) % k != 0:
                out.append(AxisRule(tuple(_in_units(p, u) for p in r.inputs),
                                    tuple(_in_units(p, u) for p in r.outputs)))
    return out


def _in_units(p: Placement, u: int) -> Placement:
    return Shard(p.dim, u) if type(p) is Shard else p


def uneven_exact(specs: tuple[Spec, ...], mesh_shape: tuple[int, ...]) -> bool:
    """On every axis that cuts some tensor unevenly, all the op's sharded dims on that
    axis have one number of units (one size, under unit 1) and none of its values is an
    average (see the module docstring)."""
    for a in sorted({a for s in specs for a in s.uneven_axes(mesh_shape)}):
        placed = [(s.placements[a], s.meta) for s in specs]
        sizes = {units_of(m.shape[p.dim], p) for p, m in placed if type(p) is Shard}
        if len(sizes) > 1 or any(p == Partial("avg") for p, _ in placed):
            return False
    return True
