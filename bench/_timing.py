"""Step timing shared by the benchmarks: median over steps, slowest rank."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def median_step_s(step: Callable[[], object], steps: int, warmup: int = 2) -> float:
    return median_steps_s({"": step}, steps, warmup)[""]


def median_steps_s(sides: dict[str, Callable[[], object]], steps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per step of each side, the slowest rank's. The sides take turns,
    one step each per round, so a shared machine's slow spells fall on every side alike
    (timed one after the other, whichever side ran during a busy minute lost)."""
    for _ in range(warmup):
        for step in sides.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(steps):
        for name, step in sides.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times[name]) for name in sides], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(sides, t.tolist()))
