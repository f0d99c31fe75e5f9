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

    @register(aten.mm.default)
    def mm(call: OpCall) -> list[AxisRule]:
        return einsum_rules("mk,kn->mn", call)
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Iterable, Optional

from autopar.core.placement import Partial, Placement, R, Shard, Spec, TensorMeta


@dataclass(frozen=True)
class TensorArg:
    """Stands for the i-th tensor input inside OpCall.args (the graph node is elsewhere)."""

    index: int


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
_RULES: dict[Any, RuleFn] = {}
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


def rule_for(target: Any) -> Optional[RuleFn]:
    return _RULES.get(target) or _RULES_BY_NAME.get(str(target))


def registered_targets() -> frozenset:
    return frozenset(_RULES) | frozenset(_RULES_BY_NAME)


def replicate_rule(call: OpCall) -> list[AxisRule]:
    return [AxisRule((R,) * len(call.inputs), (R,) * len(call.outputs))]


def expand(rules: Iterable[AxisRule], call: OpCall, mesh_shape: tuple[int, ...], uneven: bool = False
           ) -> list[Strategy]:
    """Product of per-axis rules over the mesh; keeps first-seen order. Drops uneven
    shards unless `uneven`, and then keeps only those `uneven_exact` allows."""
    rules = list(dict.fromkeys(rules))
    replicated = [r for r in rules if all(p == R for p in r.inputs + r.outputs)] or rules
    # a mesh axis of size 1 holds everything whole: R is the only distinct layout there
    per_axis = [rules if n > 1 else replicated for n in mesh_shape]
    out: dict[Strategy, None] = {}
    for combo in product(*per_axis):
        ins = tuple(Spec(tuple(r.inputs[i] for r in combo), m) for i, m in enumerate(call.inputs))
        outs = tuple(Spec(tuple(r.outputs[i] for r in combo), m) for i, m in enumerate(call.outputs))
        if all(s.fits(mesh_shape) for s in ins + outs) or (
                uneven and all(s.fits(mesh_shape, uneven=True) for s in ins + outs)
                and uneven_exact(ins + outs, mesh_shape)):
            out[Strategy(ins, outs)] = None
    return list(out)


def uneven_exact(specs: tuple[Spec, ...], mesh_shape: tuple[int, ...]) -> bool:
    """On every axis that cuts some tensor unevenly, all the op's sharded dims on that
    axis have one size and none of its values is an average (see the module docstring)."""
    for a in sorted({a for s in specs for a in s.uneven_axes(mesh_shape)}):
        placed = [(s.placements[a], s.meta) for s in specs]
        sizes = {m.shape[p.dim] for p, m in placed if type(p) is Shard}
        if len(sizes) > 1 or any(p == Partial("avg") for p, _ in placed):
            return False
    return True
