"""Run an example's `run(rank, world, args)` on gloo ranks: under torchrun when launched
by it, else on as many spawned processes as the mesh has devices."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def mesh_size(mesh: str) -> int:
    size = 1
    for s in mesh.split(","):
        size *= int(s)
    return size


def _spawned(rank: int, world: int, store: str, run: Callable, args: Any, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        run(rank, world, args)
    finally:
        dist.destroy_process_group()


def launch(run: Callable, args: Any, world: int, timeout_s: float = 600) -> None:
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        try:
            run(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(world, os.path.join(tmp, "store"), run, args, timeout_s), nprocs=world,
                           start_method="spawn")
