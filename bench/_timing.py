"""Step timing shared by the benchmarks: median over steps, slowest rank."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def median_step_s(step: Callable[[], object], steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
