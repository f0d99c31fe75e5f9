"""R of the ILP (passes/solve/ilp.py): the reshard steps between a producer's output spec and
the spec a consumer strategy reads, and their cost, memoised on the values they depend
on: the source spec, the consumer's input spec and its grad-sync axes (the tensor meta
is in the specs, the mesh and the device in the cost model).

The grad-sync axes of an input are the mesh axes on which the consumer does split work
while reading that input as R (autopar/core/resharding.py): their backward all-reduces.
"""

from __future__ import annotations

from math import prod
from typing import Optional, Protocol, Sequence

import torch

from autopar.core.placement import R, Spec, TensorMeta, local_shape
from autopar.core.resharding import Step, Unreachable, reshard_moves, reshard_steps, split_axes
from autopar.cost_models.model import CostModel
from autopar.cost_models.hiding import NO_SHARE, Hideable, Share

INF = float("inf")  # the cost of an unreachable reshard (and, in passes/solve/ilp.py, of an impossible choice)


class Layouts(Protocol):
    """A strategy (passes/rules): the spec of each input and output."""

    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]


def grad_sync_axes(strategy: Layouts, position: int) -> tuple[int, ...]:
    """Mesh axes along which the consumer's copies of a replicated input each give it a
    partial gradient, to be summed. None, (), for the output node (no outputs of its own):
    what it returns is the caller's, whose backward seeds each rank's gradient, of a
    whole output and of a split one's block alike."""
    if not strategy.outputs:
        return ()
    dst = strategy.inputs[position]
    return tuple(a for a in split_axes(strategy.inputs, strategy.outputs) if dst.placements[a] == R)


DstKey = tuple[int, tuple[int, ...]]  # a dst class: (numbered input spec, grad-sync axes)


class EdgePricer:
    """R: reshard steps and their cost, memoised on what they depend on: the source spec,
    the consumer's input spec and its grad-sync axes (the tensor meta is in the specs,
    the mesh in the cost model). Specs are numbered once per object, so the ~10^5 lookups
    of an edge matrix hash small ints instead of walking placements and metas. A pure
    function behind its memo: every answer depends only on the arguments and the cost
    model, whatever order the ILP's builder asks in."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self._number: dict[Spec, int] = {}  # spec (by value) -> its number
        self._specs: list[Spec] = []  # number -> spec
        self._layout: list[int] = []  # spec number -> the number of its placements
        self._layouts: dict[tuple, int] = {}
        self._seen: dict[int, tuple[object, object]] = {}  # id(obj) -> (obj, memo): holding obj keeps its id its own
        self._steps: dict[tuple[int, DstKey], Optional[tuple[Step, ...]]] = {}
        self._cost: dict[tuple[int, DstKey], float] = {}
        self._moves: dict[tuple, Optional[tuple[Step, ...]]] = {}  # (layouts, ndim, grad-sync axes) -> moves
        self._unpaid: dict[tuple[int, DstKey, Share], float] = {}
        self._hideable: dict[tuple[int, DstKey], Hideable] = {}
        self._step_s: dict[tuple, float] = {}  # (kind, backward, axis, local bytes, differentiable) -> seconds
        self._tables: dict[tuple, torch.Tensor] = {}  # (src classes, dst classes, share) -> R over them

    def spec_id(self, spec: Spec) -> int:
        hit = self._seen.get(id(spec))
        if hit is None:
            n = self._number.setdefault(spec, len(self._number))
            if n == len(self._specs):
                self._specs.append(spec)
                self._layout.append(self._layouts.setdefault(spec.placements, len(self._layouts)))
            hit = self._seen[id(spec)] = (spec, n)
        return hit[1]

    def dst_key(self, consumer: Layouts, position: int) -> DstKey:
        hit = self._seen.get(id(consumer))
        if hit is None:
            keys = tuple((self.spec_id(d), grad_sync_axes(consumer, p)) for p, d in enumerate(consumer.inputs))
            hit = self._seen[id(consumer)] = (consumer, keys)
        return hit[1][position]

    def steps_between(self, src: int, dst: DstKey) -> Optional[tuple[Step, ...]]:
        key = (src, dst)
        if key not in self._steps:
            try:
                self._steps[key] = reshard_steps(self._specs[src], self._specs[dst[0]], dst[1])
            except Unreachable:
                self._steps[key] = None
        return self._steps[key]

    def cost_between(self, src: int, dst: DstKey) -> float:
        key = (src, dst)
        cost = self._cost.get(key)
        if cost is None:
            spec, to = self._specs[src], self._specs[dst[0]]
            moves_key = (self._layout[src], self._layout[dst[0]], spec.meta.ndim, dst[1])
            if spec.meta is not to.meta and spec.meta != to.meta:
                raise ValueError(f"reshard between different tensors: {spec.meta} vs {to.meta}")
            moves = self._moves.get(moves_key, ())
            if moves == ():
                moves = self._moves[moves_key] = reshard_moves(spec, to, dst[1])
            cost = self._cost[key] = INF if moves is None else self._moves_s(moves, spec.meta)
        return cost

    def _moves_s(self, moves: tuple[Step, ...], meta: TensorMeta) -> float:
        """CostModel.moves_cost(moves, meta).total_s, each step's seconds memoised on what
        they depend on (CostModel._step_s): its kinds forward and backward, its axis and its
        local bytes; keyed by the step itself, the memo missed on nearly every call (10^5 move
        sequences share a few hundred distinct steps: kimi_linear (2, 4))."""
        total = 0.0
        mesh, itemsize, differentiable = self.costs.mesh_shape, meta.dtype.itemsize, meta.dtype.is_floating_point
        for s in moves:
            local = prod(local_shape(s.before.placements, meta.shape, mesh)) * itemsize
            key = (s.kind, s.backward, s.axis, local, differentiable)
            step_s = self._step_s.get(key)
            if step_s is None:
                step_s = self._step_s[key] = self.costs.step_s(s, local, differentiable)
            total += step_s
        return total

    def unpaid_between(self, src: int, dst: DstKey, share: Share) -> float:
        """What of the reshard a step does not pay were it a parameter's edge with `share`
        (cost_models/overlap.py): the part a reduction once per several backwards saves
        (amortised_s) and what hides (hidden_s); 0 for an unreachable pair."""
        key = (src, dst, share)
        h = self._unpaid.get(key)
        if h is None:
            parts = self._hideable.get((src, dst))
            if parts is None:  # what could hide of the pair, whatever the share: ~10^5 shares meet a few pairs
                parts = self._hideable[(src, dst)] = Hideable.of(self.steps_between(src, dst) or (), self.costs)
            h = self._unpaid[key] = parts.unpaid_s(share)
        return h

    def price_between(self, src: int, dst: DstKey, share: Share = NO_SHARE) -> float:
        """R less what the step does not pay of it: a parameter edge with `share` of its
        bucket's stretch and of its prefetch window (cost_models/overlap.py) pays R - hidden,
        and under a reduction once per n backwards its bucket's part only 1/n times."""
        cost = self.cost_between(src, dst)
        if not share or cost == INF:
            return cost
        return cost - self.unpaid_between(src, dst, share)

    def price_table(self, src: Sequence[int], dst: Sequence[DstKey], share: Share = NO_SHARE) -> torch.Tensor:
        """price_between over every src class (rows) and dst class (columns), float64
        seconds, memoised on the two class lists and the share: the edges of L identical
        blocks carry value-equal specs between the same classes, so their tables are built
        once, not L times (what dominance pruning and the ILP's edge terms both read)."""
        key = (tuple(src), tuple(dst), share)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = torch.tensor([[self.price_between(o, r, share) for r in key[1]]
                                                      for o in key[0]], dtype=torch.float64)
        return table

    def price_s(self, src: Spec, consumer: Layouts, position: int, share: Share = NO_SHARE) -> float:
        return self.price_between(self.spec_id(src), self.dst_key(consumer, position), share)

    def steps(self, src: Spec, consumer: Layouts, position: int) -> Optional[tuple[Step, ...]]:
        return self.steps_between(self.spec_id(src), self.dst_key(consumer, position))

    def cost_s(self, src: Spec, consumer: Layouts, position: int) -> float:
        return self.cost_between(self.spec_id(src), self.dst_key(consumer, position))
