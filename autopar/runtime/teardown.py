"""A finished job takes torch.distributed down before the interpreter does.

torch holds every process group in C++ registries (the functional collectives find
their group by name there) until the process's static destructors run, after Python
has finalised. gloo's threads are then torn down in an order that can abort a process
whose work is done: "terminate called without an active exception", SIGABRT, and
torchrun reports the job failed. Plain torch shows it: twenty functional all-reduces on a
new_group over gloo, two ranks that never call destroy_process_group, abort in about
one run in ten on a busy machine. autopar makes such groups and collectives, so its
first group registers one exit hook (`take_down_at_exit`), which at interpreter exit:

1. does nothing if the default group is gone (the user destroyed it: their order wins);
2. after a clean run, meets the other ranks at a barrier, so that no rank closes its
   connections while a peer still has a message in flight to it (a peer that died
   makes the barrier fail at once; one that hangs, wait out the group's timeout);
   after an uncaught exception it skips the barrier, as the peers may never come;
3. destroys every process group, the default last (torch's destroy_process_group()),
   while Python and gloo's threads are alive, and forgets autopar's cached groups.
"""

from __future__ import annotations

import atexit
import sys
from typing import Callable

import torch.distributed as dist

_registered: list[bool] = []


def take_down_at_exit(forget: Callable[[], None]) -> None:
    """Register the exit hook once per process; `forget` drops autopar's cached groups."""
    if _registered:
        return
    _registered.append(True)
    atexit.register(_take_down, forget)


def _take_down(forget: Callable[[], None]) -> None:
    if not (dist.is_available() and dist.is_initialized()):  # 1.
        return
    failed = getattr(sys, "last_value", None) is not None  # set by an uncaught exception
    try:
        if not failed:
            dist.barrier()  # 2.
    finally:
        dist.destroy_process_group()  # 3.
        forget()
