"""Run an example's `run(rank, world, args)` on gloo ranks: under torchrun when launched
by it, else on as many spawned processes as the mesh has devices."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import _compat


def mesh_size(mesh: str) -> int:
    size = 1
    for s in mesh.split(","):
        size *= int(s)
    return size


def _spawned(rank: int, world: int, store: str, run: Callable, args: Any, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    run_then_leave(run, args)


def run_then_leave(run: Callable, args: Any) -> None:
    """run(rank, world, args) in the initialised group, then every rank leaves together.
    A rank that tears gloo down while a peer is still busy (rank 0 writing the final
    state after the last collective) can abort that peer: under torchrun the agent then
    restarts a run that had finished. So a run that ended well meets at a barrier before
    destroying its group; one that failed leaves at once (its peers time out or are
    stopped by the agent)."""
    _compat.report_fatal_signals()  # a rank killed by a signal prints where each thread was, native frames too
    finished = False
    try:
        run(dist.get_rank(), dist.get_world_size(), args)
        finished = True
    finally:
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def init_torchrun_group(timeout_s: float) -> None:
    """The gloo default group of this torchrun attempt, on one node or several (ranks are
    numbered node-major: GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK). torchrun (2.4 and
    later) shares its agent's TCPStore with the workers and keeps it across restarts, so a
    restarted group would find the dead attempt's gloo addresses under the same keys
    (pytorch/pytorch#135712); a prefix per attempt keeps each attempt's keys apart. It is
    the restart count and the world size, which every rank of an attempt agrees on while
    the agents have restarted alike (one node, or nodes that all failed together; a group
    regrown by a joining node keeps the count but not the world size). Agents whose
    counts can differ (a node that joined later starts at 0) need
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun: each attempt then gets a fresh
    store, and no prefix is used."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-world{world}"
        store = dist.PrefixStore(f"attempt{attempt}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def launch(run: Callable, args: Any, world: int, timeout_s: float = 600) -> None:
    if "RANK" in os.environ:  # under torchrun
        init_torchrun_group(timeout_s)
        run_then_leave(run, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(world, os.path.join(tmp, "store"), run, args, timeout_s), nprocs=world,
                           start_method="spawn")
