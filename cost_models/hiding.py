"""What of one reshard step can hide, given its edge's share of the compute around it
(cost_models/overlap.py makes the shares; the edge prices, evaluate() and a plan's
read-back price with these): a parameter edge's gradient reduction under its bucket's
backward stretch, its prefetched gather under its window, and the part of a reduction
that runs once per several backwards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from autopar.core.kinds import StepKind
from autopar.core.resharding import Step
from autopar.cost_models.model import CostModel


@dataclass(frozen=True)
class Share:
    """A parameter edge's shares of the compute its collectives may hide under: its
    bucket's backward stretch, and its prefetch window's forward and backward seconds."""

    bucket_s: float = 0.0
    window_forward_s: float = 0.0
    window_backward_s: float = 0.0
    sync_every: int = 1  # backwards per bucket reduction (Options.grad_sync_every): each pays 1/n of it

    def __bool__(self) -> bool:
        return self.bucket_s > 0.0 or self.window_forward_s > 0.0 or self.window_backward_s > 0.0 \
            or self.sync_every > 1


NO_SHARE = Share()


def credit_s(hideable: float, share: float) -> float:
    """hidden_e = min(H_e, share_e)."""
    return min(hideable, share)


def prefetch_hideable_s(steps: Sequence[Step], costs: CostModel) -> tuple[float, float]:
    """(Hf, Hb): forward and backward seconds of a parameter edge's first step where the
    schedule prefetches it (it communicates, is no grad sync) on a preset whose
    collectives run beside compute; (0, 0) elsewhere."""
    if not steps or not costs.device.collectives_beside_compute:
        return 0.0, 0.0
    first = steps[0]
    if not first.kind.communicates or first.kind is StepKind.GRAD_SYNC:
        return 0.0, 0.0
    forward = replace(costs, training=False).steps_cost((first,)).comm_s
    both = costs.steps_cost((first,)).comm_s
    return forward, both - forward


@dataclass(frozen=True)
class Hideable:
    """What of one reshard could hide, whatever the edge's share: its bucket's reduction H
    (hideable_s) and its prefetch's forward and backward parts (prefetch_hideable_s)."""

    bucket_s: float
    forward_s: float
    backward_s: float

    @staticmethod
    def of(steps: Sequence[Step], costs: CostModel) -> "Hideable":
        return Hideable(hideable_s(steps, costs), *prefetch_hideable_s(steps, costs))

    def hidden_s(self, share: Share) -> float:
        """hidden_s of these steps with `share`."""
        if not share:
            return 0.0
        return (credit_s(self.bucket_s / share.sync_every, share.bucket_s)
                + credit_s(self.forward_s, share.window_forward_s) + credit_s(self.backward_s, share.window_backward_s))

    def unpaid_s(self, share: Share) -> float:
        """amortised_s + hidden_s of these steps with `share`: what a step does not pay of them."""
        return _amortised(self.bucket_s, share.sync_every) + self.hidden_s(share)


def hidden_s(steps: Sequence[Step], costs: CostModel, share: Share) -> float:
    """What of an edge's reshard hides: its bucket's credit (on the part of the reduction
    each backward pays, amortised_s) and its prefetch's."""
    return Hideable.of(steps, costs).hidden_s(share) if share else 0.0


def amortised_s(steps: Sequence[Step], costs: CostModel, sync_every: int) -> float:
    """Of a parameter edge's price, what each backward does not pay where the bucket
    reduces once per `sync_every` backwards (a pipeline stage's microbatches): the
    reduction H it carries, less H / sync_every."""
    return _amortised(hideable_s(steps, costs), sync_every) if sync_every > 1 else 0.0


def _amortised(bucket_s: float, sync_every: int) -> float:
    """Of a reduction H made once per `sync_every` backwards, what each does not pay."""
    return 0.0 if sync_every <= 1 else bucket_s * (1.0 - 1.0 / sync_every)


def hideable_s(steps: Sequence[Step], costs: CostModel) -> float:
    """H: seconds of a parameter edge's reduction that a bucket carries: the backward of
    its first grad sync, when every step is a grad sync (the rewrite defers exactly those)."""
    if not costs.training or not steps or any(s.kind is not StepKind.GRAD_SYNC for s in steps):
        return 0.0
    return costs.steps_cost(tuple(steps[:1])).comm_s
