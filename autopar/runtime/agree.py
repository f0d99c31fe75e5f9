"""One plan for every rank: rank 0 solves, the others receive it, all check they agree.

    every rank: traced graph ---------------------.
    rank 0:     (measure) -> solve -> broadcast ---+-> fingerprint check -> all-gather
    others:                      receive ---------'   (digest, error) -> same plan or raise

1. Every rank holds the traced graph (shipping.py: rank 0 traces, the others rebuild
   its graph), or the error its tracing met (kept, not raised yet).
2. Rank 0 solves (one solve instead of one per rank) and broadcasts the plan, or the
   error it met; with given plans (a Plan, a PlanBook or a file of either), the one made
   for the traced graph's fingerprint is checked against the trace instead.
3. Every rank gathers every rank's plan digest and error. An error anywhere is raised
   on every rank as the same type (the exception itself travels; one that cannot be
   pickled becomes a PlanningError with its type and text); differing digests raise
   ProcessGroupError. No rank is left waiting in a collective.

`group`: the ranks that agree (a pipeline stage's sub-mesh); None for the whole world.
"Rank 0" is then the group's first rank.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Optional

import torch.distributed as dist

from autopar.core.errors import FingerprintMismatchError, PlanningError, ProcessGroupError
from autopar.core.plan import Plan
from autopar.core.kinds import NodeKind
from autopar.core.placement import TensorMeta
from autopar.core.plan_book import PlanBook, PricedAt
from autopar.passes.lower.emit import check_fingerprint
from autopar.passes.trace.trace import TracedGraph

# what rank 0 runs to plan a traced graph (it may measure first, with every rank: see module.py)
Solve = Callable[[TracedGraph], Plan]


def agreed_plan(traced: Optional[TracedGraph], problem: Optional[Exception], solve: Solve,
                given: Optional[PlanBook], given_source: str, group: Any = None) -> Plan:
    """The plan every rank runs for `traced` (None where this rank failed to trace, with
    `problem` the error): `given`'s plan for its graph, or rank 0's solve; or the first
    error any rank met, raised on every rank."""
    rank = dist.get_rank(group)
    plan: Optional[Plan] = None
    if given is not None:
        if problem is None:
            plan, problem = attempt(lambda: _from_book(given, traced, given_source))
    else:
        plan, problem = _solved_on_rank0(traced, problem, solve, rank, group)
    _agree(plan, problem, group)
    assert plan is not None
    return plan


def _from_book(book: PlanBook, traced: TracedGraph, source: str) -> Plan:
    plan = book.plan_for(traced.fingerprint, _priced_at(traced), traced.model_name, source)
    check_fingerprint(plan, traced, source)
    return plan


def _priced_at(traced: TracedGraph) -> PricedAt:
    """The sizes a plan of `traced` is priced at: its user inputs' (hint) shapes."""
    users = {gi.name for gi in traced.inputs if gi.kind is NodeKind.USER_INPUT}
    return tuple(sorted((n.name, TensorMeta.of(n.meta["val"]).shape) for n in traced.gm.graph.nodes
                        if n.op == "placeholder" and n.name in users))


def _solved_on_rank0(traced: Optional[TracedGraph], problem: Optional[Exception], solve: Solve,
                     rank: int, group: Any = None) -> tuple[Optional[Plan], Optional[Exception]]:
    """Rank 0's plan through `agreed` (rank 0's tracing error, or its solve's, reaches every
    rank); a rank's own tracing error comes first."""
    plan, error = attempt(lambda: agreed(lambda: _raise(problem) if problem is not None else solve(traced), group))
    if problem is not None:
        return None, problem
    if error is not None:
        return None, error
    if plan.fingerprint != traced.fingerprint:
        return None, FingerprintMismatchError(
            f"rank {rank} traced a different graph (fingerprint {traced.fingerprint}) than rank 0 "
            f"({plan.fingerprint}); every rank must pass the same model and input shapes",
            expected=plan.fingerprint, found=traced.fingerprint)
    return plan, None


def _raise(error: Exception) -> Any:
    raise error


def attempt(fn: Callable[[], Any]) -> tuple[Any, Optional[Exception]]:
    """(fn(), None) or (None, its error): the error is forwarded so that the other ranks
    fail too instead of waiting in a collective."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
        return None, e


def agreed(make: Callable[[], Any], group: Any = None) -> Any:
    """What the group's first rank makes (a plan), sent to every rank of the group; an
    error there is raised on every rank. The one way ranks take rank 0's work."""
    box: list = [None]
    error: Optional[Exception] = None
    if dist.get_rank(group) == 0:
        value, error = attempt(make)
        box[0] = value if error is None else sendable(error)
    dist.broadcast_object_list(box, src=first_rank(group), group=group)
    if error is not None:  # the first rank raises its own error, traceback and all
        raise error
    if isinstance(box[0], Exception):
        raise from_rank(box[0], first_rank(group))
    return box[0]


def first_rank(group: Any) -> int:
    """The global rank of the group's rank 0 (0 for the whole world)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _agree(plan: Optional[Plan], problem: Optional[Exception], group: Any = None) -> None:
    mine = (plan.digest() if plan is not None else None, sendable(problem) if problem is not None else None)
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, mine, group=group)
    if problem is not None:
        raise problem
    failed = [(r, err) for r, (_, err) in enumerate(seen) if err is not None]
    if failed:
        raise from_rank(failed[0][1], failed[0][0])
    digests = [d for d, _ in seen]
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise ProcessGroupError(
            f"ranks run different plans: rank 0 has plan {digests[0]}, ranks {odd} have "
            f"{sorted(set(digests[r] for r in odd))}; give every rank the same model, inputs and plan file")


def sendable(error: Exception) -> Exception:
    """The error itself if it survives a trip through pickle, else a PlanningError naming it."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 - anything unpicklable is described instead
        pass
    return PlanningError(f"{type(error).__name__}: {error}")


def from_rank(error: Exception, rank: int) -> Exception:
    note = f"(raised on rank {rank} while planning; this rank stops too)"
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)
    return error
