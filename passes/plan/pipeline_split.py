"""The stage DP of passes/plan/pipeline.py, with the per-rank memory budget as a constraint.

    Units (price and bytes of each block) + sends + stages [+ MemoryBound] -> block ranges

The DP picks contiguous block ranges, one per stage, minimising the slowest stage:
    F[k][j] = min over i with fits(i, j, k-1) of max(F[k-1][i], cost(i, j))
where fits(i, j, k) holds when stage k holding blocks i..j-1 stays under the budget:
    bytes(i, j, k) = sum_b (param[b] + state[b]) + in_flight(k) * sum_b act[b]   <= cap
(param: parameters; state: gradients and optimiser state in training; act: one
microbatch's op outputs; in_flight: microbatches whose activations stage k holds at
once, all M under GPipe, min(M, S - k) under 1F1B). One stage per rank (GPipe, 1F1B): cap
is the budget and the bound is exact. Interleaved 1F1B puts v stages on each rank: cap is
budget / v, enough (not needed) for the rank's sum to fit; when no split meets it,
passes/plan/pipeline.py takes smallest_split's if its ranks' exact sums fit.

When no split fits, the same DP with bytes in place of seconds gives the smallest
heaviest stage any split reaches: the figure PipelineMemoryError reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

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
        """bytes(i, j, k) of the module docstring: stage `index` holding blocks i..j-1."""
        held = sum(units.param_bytes[i:j]) + sum(units.state_bytes[i:j])
        return held + in_flight_count(self.schedule, index, n_stages, self.microbatches) * sum(
            units.activation_bytes[i:j])

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
    blocks = len(units.block_s)
    prefix = [0.0]
    for c in units.block_s:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, k: int) -> float:
        if bound is not None and bound.stage_bytes(units, i, j, k, stages) > bound.stage_cap_bytes:
            return float("inf")
        return (prefix[j] - prefix[i] + (units.before_s if i == 0 else 0.0)
                + (units.after_s if j == blocks else send_s[j - 1]))
    return _min_max_split(blocks, stages, cost)


def smallest_split(units: Units, stages: int, bound: MemoryBound) -> tuple[tuple[int, int], ...]:
    """The split whose heaviest stage holds the fewest bytes."""
    found = _min_max_split(len(units.block_s), stages,
                           lambda i, j, k: float(bound.stage_bytes(units, i, j, k, stages)))
    assert found is not None  # every split has finite bytes
    return found


def rank_bytes(units: Units, stages: tuple[Stage, ...], schedule: Schedule, microbatches: int
               ) -> tuple[int, int, int]:
    """(parameter, gradient + optimiser state, activation) bytes of the heaviest pipeline
    rank: the sum over the stages it holds."""
    per_rank: dict[int, tuple[int, int, int]] = {}
    for s in stages:
        live = in_flight(schedule, s, len(stages), microbatches)
        old = per_rank.get(s.rank, (0, 0, 0))
        per_rank[s.rank] = (old[0] + sum(units.param_bytes[s.first:s.stop]),
                            old[1] + sum(units.state_bytes[s.first:s.stop]),
                            old[2] + live * sum(units.activation_bytes[s.first:s.stop]))
    return max(per_rank.values(), key=sum)
