"""The stage DP of passes/plan/pipeline.py, with the per-rank memory budget as a constraint.

    Units (price and bytes of each block) + sends + stages [+ MemoryBound] -> block ranges

The DP picks contiguous block ranges, one per stage, minimising the slowest stage:
    F[k][j] = min over i with fits(i, j, k-1) of max(F[k-1][i], cost(i, j))
where fits(i, j, k) holds when stage k holding blocks i..j-1 stays under the budget:
    bytes(i, j, k) = sum_b (param[b] + state[b]) + in_flight(k) * (sum_b act[b] + recv[i])   <= cap
(param: parameters; state: gradients and optimiser state in training; act: one
microbatch's op outputs; recv[i]: the values a stage starting at block i receives,
whole; in_flight: microbatches whose activations stage k holds at
once, all M under GPipe, min(M, S - k) under 1F1B). One stage per rank (GPipe, 1F1B): cap
is the budget and the bound is exact. Interleaved 1F1B puts v stages on each rank: cap is
budget / v, enough (not needed) for the rank's sum to fit; when no split meets it,
passes/plan/pipeline.py takes smallest_split's if its ranks' exact sums fit.

split_frontier lets each stage take any of several Units of the same blocks (the
frontier of leaner sub-mesh plans, passes/plan/pipeline_units.py): cost(i, j, k) is the
least seconds of a point whose bytes fit. When no split fits, the same DP with bytes in
place of seconds (each stage at its lightest point) gives the smallest heaviest stage any
split reaches: the figure PipelineMemoryError reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from autopar.core.pipeline import Schedule, Stage


@dataclass(frozen=True)
class Units:
    """What the stage DP chooses over: the price of each block and of the parts around
    them, the bytes crossing each boundary between blocks, and each block's bytes per rank
    (the part before the blocks counted with block 0, the part after with the last)."""

    container: str
    block_s: tuple[float, ...]  # one microbatch through block i (forward + backward in training)
    before_s: float  # the nodes before the first block (embeddings): stage 0
    after_s: float  # the nodes after the last block (final norm, head, loss): the last stage
    boundary_bytes: tuple[int, ...]  # [j]: bytes sent from block j to block j+1 (len = blocks - 1)
    param_bytes: tuple[int, ...] = ()  # [i]: block i's parameters and buffers per rank
    state_bytes: tuple[int, ...] = ()  # [i]: their gradients and optimiser state (training)
    activation_bytes: tuple[int, ...] = ()  # [i]: block i's op outputs for one microbatch


@dataclass(frozen=True)
class MemoryBound:
    """The per-rank budget the stage split must respect, and what sets activations in flight."""

    budget_bytes: int
    schedule: Schedule
    microbatches: int

    def stage_bytes(self, units: Units, i: int, j: int, index: int, n_stages: int) -> int:
        """bytes(i, j, k) of the module docstring: stage `index` holding blocks i..j-1, and
        per microbatch in flight the activations it makes and those it receives (whole)."""
        held = sum(units.param_bytes[i:j]) + sum(units.state_bytes[i:j])
        received = units.boundary_bytes[i - 1] if i > 0 else 0
        return held + in_flight_count(self.schedule, index, n_stages, self.microbatches) * (
            sum(units.activation_bytes[i:j]) + received)

    @property
    def stage_cap_bytes(self) -> int:
        return self.budget_bytes // self.schedule.chunks_per_rank


def in_flight_count(schedule: Schedule, index: int, n_stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage `index` holds at once: all of them under GPipe
    (every forward before any backward), at most the stages after it under 1F1B."""
    if schedule is Schedule.GPIPE:
        return microbatches
    return min(microbatches, n_stages - index)


def in_flight(schedule: Schedule, stage: Stage, n_stages: int, microbatches: int) -> int:
    return in_flight_count(schedule, stage.index, n_stages, microbatches)


def _min_max_split(blocks: int, stages: int, cost: Callable[[int, int, int], float]
                   ) -> Optional[tuple[tuple[int, int], ...]]:
    """Contiguous ranges minimising max_k cost(i, j, k) (cost inf: not allowed); None when
    every split has an infinite stage. Ties go to the earliest split."""
    inf = float("inf")
    best = [[inf] * (blocks + 1) for _ in range(stages + 1)]
    cut = [[0] * (blocks + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, blocks + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j, k - 1))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[stages][blocks] == inf:
        return None
    ranges, j = [], blocks
    for k in range(stages, 0, -1):
        ranges.append((cut[k][j], j))
        j = cut[k][j]
    return tuple(reversed(ranges))


def split_stages(units: Units, send_s: tuple[float, ...], stages: int,
                 bound: Optional[MemoryBound] = None) -> Optional[tuple[tuple[int, int], ...]]:
    """The fastest split whose every stage fits `bound` (any split without one); None when
    none fits."""
    found = split_frontier((units,), send_s, stages, bound)
    return None if found is None else found[0]


def split_frontier(frontier: Sequence[Units], send_s: tuple[float, ...], stages: int,
                   bound: Optional[MemoryBound] = None) -> Optional[tuple[tuple[tuple[int, int], ...], Units]]:
    """split_stages where each stage may take any point of `frontier` (Units of the same
    blocks, each a plan of its own: passes/plan/pipeline_units.py): the fastest point whose
    bytes fit. The ranges, and the Units each block has at its stage's point; None when no
    split fits."""
    blocks = len(frontier[0].block_s)
    prefixes = []
    for units in frontier:
        prefix = [0.0]
        for c in units.block_s:
            prefix.append(prefix[-1] + c)
        prefixes.append(prefix)

    def point(i: int, j: int, k: int) -> tuple[float, int]:
        fitting = [(_seconds(units, prefix, i, j, blocks, send_s), p)
                   for p, (units, prefix) in enumerate(zip(frontier, prefixes))
                   if bound is None or bound.stage_bytes(units, i, j, k, stages) <= bound.stage_cap_bytes]
        return min(fitting, default=(float("inf"), -1))
    ranges = _min_max_split(blocks, stages, lambda i, j, k: point(i, j, k)[0])
    if ranges is None:
        return None
    return ranges, mixed_units(frontier, ranges, [point(i, j, k)[1] for k, (i, j) in enumerate(ranges)])


def _seconds(units: Units, prefix: list[float], i: int, j: int, blocks: int, send_s: tuple[float, ...]) -> float:
    return (prefix[j] - prefix[i] + (units.before_s if i == 0 else 0.0)
            + (units.after_s if j == blocks else send_s[j - 1]))


def mixed_units(frontier: Sequence[Units], ranges: Sequence[tuple[int, int]], points: Sequence[int]) -> Units:
    """Units whose blocks take the figures of the point their stage chose (the part before
    the blocks stage 0's, the part after the last stage's)."""
    if len(frontier) == 1:
        return frontier[0]
    of_block = [frontier[p] for (i, j), p in zip(ranges, points) for _ in range(i, j)]

    def per_block(name: str) -> tuple:
        return tuple(getattr(u, name)[b] for b, u in enumerate(of_block))
    first, last = frontier[points[0]], frontier[points[-1]]
    return replace(first, block_s=per_block("block_s"), after_s=last.after_s, param_bytes=per_block("param_bytes"),
                   state_bytes=per_block("state_bytes"), activation_bytes=per_block("activation_bytes"))


def smallest_split(units: "Units | Sequence[Units]", stages: int, bound: MemoryBound
                   ) -> tuple[tuple[tuple[int, int], ...], Units]:
    """The split whose heaviest stage holds the fewest bytes, each stage at its lightest
    point of the frontier (one Units: that one), with the Units it holds."""
    frontier = (units,) if isinstance(units, Units) else tuple(units)

    def lightest(i: int, j: int, k: int) -> tuple[int, int]:
        return min((bound.stage_bytes(u, i, j, k, stages), p) for p, u in enumerate(frontier))
    found = _min_max_split(len(frontier[0].block_s), stages, lambda i, j, k: float(lightest(i, j, k)[0]))
    assert found is not None  # every split has finite bytes
    return found, mixed_units(frontier, found, [lightest(i, j, k)[1] for k, (i, j) in enumerate(found)])


def rank_bytes(units: Units, stages: tuple[Stage, ...], schedule: Schedule, microbatches: int
               ) -> tuple[int, int, int]:
    """(parameter, gradient + optimiser state, activation) bytes of the heaviest pipeline
    rank: the sum over the stages it holds."""
    per_rank: dict[int, tuple[int, int, int]] = {}
    for s in stages:
        live = in_flight(schedule, s, len(stages), microbatches)
        old = per_rank.get(s.rank, (0, 0, 0))
        received = units.boundary_bytes[s.first - 1] if s.first > 0 else 0
        per_rank[s.rank] = (old[0] + sum(units.param_bytes[s.first:s.stop]),
                            old[1] + sum(units.state_bytes[s.first:s.stop]),
                            old[2] + live * (sum(units.activation_bytes[s.first:s.stop]) + received))
    return max(per_rank.values(), key=sum)
