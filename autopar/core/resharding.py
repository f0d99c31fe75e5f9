"""From one spec to another: the ordered steps that turn a producer's layout into
the layout a consumer needs. Used by the cost model (to price an edge) and by the
rewrite (to emit it), so both always agree on what an edge does.

Each step acts on one mesh axis and has a forward and a conjugate backward:

    forward          backward           when
    all_reduce       identity           P -> R
    reduce_scatter   all_gather         P -> S(d)
    all_gather       slice              S(d) -> R, result used by replicated work
    all_gather       reduce_scatter     S(d) -> R, result used by work split on the axis
    all_to_all       all_to_all         S(d) -> S(e)
    slice            all_gather         R -> S(d)
    to_partial       identity           R -> P (coordinate 0 keeps the value, others 0)
    grad_sync        all_reduce         R used by work split on the axis (Megatron's f)

The gradient contract: the gradient of a value that is R on an axis arrives complete
and identical on every rank of that axis. grad_sync is what keeps it when a replicated
value feeds a computation whose ranks do different work (data-parallel gradient sync
and Megatron's f are both this one step).

Steps, in order: 1. resolve partials, 2. gather shards that the target does not keep
(inner axes first), 3. slice the new shards (outer axes first), 4. make partials.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

import torch

from autopar.core.kinds import StepKind
from autopar.core.placement import Partial, Placement, R, Replicate, Shard, Spec, TensorMeta


@dataclass(frozen=True)
class Step:
    """One move on one mesh axis; `dim`/`to_dim` are tensor dims where they apply."""

    kind: StepKind
    axis: int
    dim: Optional[int] = None
    to_dim: Optional[int] = None
    reduce: str = "sum"
    backward: StepKind = StepKind.IDENTITY
    before: Optional[Spec] = None  # the layout the step starts from (its local bytes)
    # the unit of the shard the step makes (slice, reduce_scatter, all_to_all's to_dim): the
    # target spec's (with_units), so not printed: a plan file, which does not store it, digests alike
    unit: int = 1

    @property
    def from_unit(self) -> int:
        """The unit of the shard the step starts from on its axis (gather, all_to_all's dim)."""
        p = self.before.placements[self.axis] if self.before is not None else None
        return p.unit if type(p) is Shard else 1

    @property
    def dim_unit(self) -> int:
        """The unit of `dim`'s shard, in either direction: the one the step makes (slice,
        reduce_scatter) or the one it starts from (all_gather, all_to_all)."""
        return self.unit if self.kind in (StepKind.SLICE, StepKind.REDUCE_SCATTER) else self.from_unit

    def __str__(self) -> str:
        args = [f"axis={self.axis}"]
        if self.dim is not None:
            args.append(f"dim={self.dim}")
        if self.to_dim is not None:
            args.append(f"to_dim={self.to_dim}")
        if self.kind is StepKind.ALL_REDUCE and self.reduce != "sum":
            args.append(f"op={self.reduce}")
        return f"{self.kind}({', '.join(args)})"


class Unreachable(Exception):
    """No sequence of steps turns the source layout into the target (e.g. S -> P)."""


def _with(spec: Spec, axis: int, p: Placement) -> Spec:
    ps = list(spec.placements)
    ps[axis] = p
    return Spec(tuple(ps), spec.meta)


def _kept_shards(cur: Spec, dst: Spec) -> set[int]:
    """Axes whose shard survives: per dim, the source's shard axes must be a prefix of
    the target's, otherwise the nesting order would be wrong and they are regathered."""
    kept: set[int] = set()
    dst_axes = _axes_by_dim(dst.placements)
    for d, src_axes in _axes_by_dim(cur.placements).items():
        if dst_axes.get(d, ())[: len(src_axes)] == src_axes and all(
                cur.placements[a] == dst.placements[a] for a in src_axes):  # a unit changes the blocks
            kept.update(src_axes)
    return kept


def _axes_by_dim(placements: tuple[Placement, ...]) -> dict[int, tuple[int, ...]]:
    """Per sharded dim, the mesh axes that split it, outermost first (Spec.shard_axes of each dim)."""
    out: dict[int, tuple[int, ...]] = {}
    for a, p in enumerate(placements):
        if type(p) is Shard:
            out[p.dim] = out.get(p.dim, ()) + (a,)
    return out


def reshard_steps(src: Spec, dst: Spec, grad_sync_axes: tuple[int, ...] = ()) -> tuple[Step, ...]:
    """Steps from `src` to `dst`; raises Unreachable when there is no path.

    `grad_sync_axes` are the mesh axes on which the consumer does split work while
    reading this value as R: their backward must all-reduce (or reduce-scatter, when
    fused into the all-gather that produced the R).

    The steps depend on the placements and the tensor's rank only, so they are planned
    once per such key (the planner asks for ~10^4 pairs) and bound to the tensor here.
    """
    moves = reshard_moves(src, dst, grad_sync_axes)
    if moves is None:
        raise Unreachable(f"no reshard path from {src} to {dst} for tensor {src.meta.shape}")
    return tuple(Step(s.kind, s.axis, s.dim, s.to_dim, s.reduce, s.backward, Spec(s.before.placements, src.meta),
                      s.unit) for s in moves)


def with_units(steps: tuple[Step, ...], dst: Spec) -> tuple[Step, ...]:
    """Steps whose made shards carry the target's units. Every step that makes a shard on
    an axis makes the target's placement there, so the unit is read off `dst`; a plan file
    stores steps without it."""
    return tuple(replace(s, unit=_unit(dst, s.axis)) if s.kind in _MAKES_SHARD else s for s in steps)


def _unit(spec: Spec, axis: int) -> int:
    p = spec.placements[axis]
    return p.unit if type(p) is Shard else 1


def reshard_moves(src: Spec, dst: Spec, grad_sync_axes: tuple[int, ...] = ()) -> Optional[tuple[Step, ...]]:
    """reshard_steps without binding: each step's `before` has the right placements on a
    stand-in tensor of the same rank (a cost model reads the bytes off the real one);
    None when there is no path."""
    if src.meta is not dst.meta and src.meta != dst.meta:
        raise ValueError(f"reshard between different tensors: {src.meta} vs {dst.meta}")
    return _moves(src.placements, dst.placements, src.meta.ndim, tuple(grad_sync_axes))


@lru_cache(maxsize=None)
def _moves(src: tuple[Placement, ...], dst: tuple[Placement, ...], ndim: int,
           grad_sync_axes: tuple[int, ...]) -> Optional[tuple[Step, ...]]:
    """The steps for a stand-in tensor of rank `ndim` (None: unreachable)."""
    meta = TensorMeta((1,) * ndim, torch.float32)
    try:
        return _plan_steps(Spec(src, meta), Spec(dst, meta), grad_sync_axes)
    except Unreachable:
        return None


def _plan_steps(src: Spec, dst: Spec, grad_sync_axes: tuple[int, ...]) -> tuple[Step, ...]:
    steps: list[Step] = []
    cur = src
    n = len(src.placements)

    # 1. resolve partials
    for a in range(n):
        p, want = cur.placements[a], dst.placements[a]
        if not isinstance(p, Partial) or p == want:
            continue
        lone_dim = isinstance(want, Shard) and all(
            b == a or (cur.placements[b] != want and dst.placements[b] != want) for b in range(n))
        if lone_dim and p.reduce == "sum":
            steps.append(Step(StepKind.REDUCE_SCATTER, a, dim=want.dim, backward=StepKind.ALL_GATHER, before=cur,
                              unit=want.unit))
            cur = _with(cur, a, want)
        else:
            steps.append(Step(StepKind.ALL_REDUCE, a, reduce=p.reduce, backward=StepKind.IDENTITY, before=cur))
            cur = _with(cur, a, R)

    # 2. all_to_all where a single axis moves its shard to a free dim; else gather
    kept = _kept_shards(cur, dst)
    for a in reversed(range(n)):
        p, want = cur.placements[a], dst.placements[a]
        if not isinstance(p, Shard) or a in kept:
            continue
        if (isinstance(want, Shard) and len(cur.shard_axes(p.dim)) == 1 and not cur.shard_axes(want.dim)
                and dst.shard_axes(want.dim) == (a,)):
            steps.append(Step(StepKind.ALL_TO_ALL, a, dim=p.dim, to_dim=want.dim, backward=StepKind.ALL_TO_ALL,
                              before=cur, unit=want.unit))
            cur = _with(cur, a, want)
            continue
        steps.append(Step(StepKind.ALL_GATHER, a, dim=p.dim, backward=StepKind.SLICE, before=cur))
        cur = _with(cur, a, R)

    # 3. slice new shards, outer axes first
    for a in range(n):
        want = dst.placements[a]
        if isinstance(want, Shard) and cur.placements[a] == R:
            steps.append(Step(StepKind.SLICE, a, dim=want.dim, backward=StepKind.ALL_GATHER, before=cur,
                              unit=want.unit))
            cur = _with(cur, a, want)

    # 4. make partials
    for a in range(n):
        p, want = cur.placements[a], dst.placements[a]
        if isinstance(want, Partial) and p == R:
            if want.reduce == "sum":
                steps.append(Step(StepKind.TO_PARTIAL, a, backward=StepKind.IDENTITY, before=cur))
            # avg or max of identical copies is the value itself: nothing to do
            cur = _with(cur, a, want)

    if cur != dst:
        raise Unreachable(f"no reshard path from {src} to {dst} for tensor {src.meta.shape}")
    return tuple(_attach_grad_sync(steps, cur, grad_sync_axes))


def _attach_grad_sync(steps: list[Step], final: Spec, axes: tuple[int, ...]) -> list[Step]:
    for a in axes:
        if final.placements[a] != R:
            continue
        last = next((i for i in reversed(range(len(steps))) if steps[i].axis == a), None)
        if last is not None and steps[last].kind is StepKind.ALL_GATHER:
            s = steps[last]
            steps[last] = Step(s.kind, s.axis, s.dim, s.to_dim, s.reduce, StepKind.REDUCE_SCATTER, s.before, s.unit)
        else:
            steps.append(Step(StepKind.GRAD_SYNC, a, backward=StepKind.ALL_REDUCE, before=final))
    return steps


_MAKES_SHARD = (StepKind.SLICE, StepKind.REDUCE_SCATTER, StepKind.ALL_TO_ALL)


def split_axes(inputs: tuple[Spec, ...], outputs: tuple[Spec, ...]) -> tuple[int, ...]:
    """Mesh axes on which an op under these specs does different work on each rank."""
    specs = inputs + outputs
    if not specs:
        return ()
    n = len(specs[0].placements)
    return tuple(a for a in range(n) if any(not isinstance(s.placements[a], Replicate) for s in specs))
