"""A finished job takes torch.distributed down before the interpreter does.

What aborts a finished gloo job at exit ("terminate called without an active
exception", SIGABRT; torchrun reports the job failed): a gloo worker thread
(ProcessGroupGloo::runLoop) drops its last reference to a collective it has just
completed after the main thread has begun Py_FinalizeEx. The work still holds
tensors whose Python objects the main thread already released, so freeing them takes
the GIL; a thread that asks for the GIL during finalisation is ended with
pthread_exit, whose unwinding through the work's noexcept destructor calls
std::terminate (a core dump of an aborted rank shows exactly this stack: runLoop ->
~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil ->
PyThread_exit_thread). The worker has a few instructions left after the main thread
sees the result, so a busy machine, which preempts it there, makes it likely. Plain
torch shows it: twenty functional all-reduces on a new_group, two gloo ranks, abort
in about one run in ten beside other jobs, with or without destroy_process_group,
which does not join gloo's threads while anything still refers to a group. Python
API calls from C++ threads during finalisation are unsafe in general
(pybind/pybind11#3274); the workaround lives here, in autopar's one exit hook
(`take_down_at_exit`, registered by its first group), which runs before
finalisation, while other threads may still take the GIL:

1. if the default group is alive: after a clean run, meet the other ranks at a
   barrier, so that no rank closes its connections while a peer still has a message
   in flight to it (a peer that died makes the barrier fail at once; one that hangs,
   wait out the group's timeout); after an uncaught exception skip it, as the peers
   may never come; then destroy every process group (the default last) and forget
   autopar's cached groups. A group the user destroyed is left to them;
2. in every case, let the GIL go until every gloo worker thread is asleep waiting for
   work (read from /proc; at most SETTLE_LIMIT_S), so none is left holding a
   finished collective when finalisation begins.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
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
    try:
        if dist.is_available() and dist.is_initialized():  # 1.
            failed = getattr(sys, "last_value", None) is not None  # set by an uncaught exception
            try:
                if not failed:
                    dist.barrier()
            finally:
                dist.destroy_process_group()
                forget()
    finally:
        settle_gloo_threads()  # 2.


SETTLE_LIMIT_S = 2.0
GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def settle_gloo_threads(limit_s: float = SETTLE_LIMIT_S) -> bool:
    """Sleep (the GIL released) until every gloo worker thread of this process has been
    seen asleep in two polls in a row, or `limit_s` passes; True when they were. Where
    /proc cannot be read, sleep 50 ms instead."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < 2:
        states = _thread_states(GLOO_WORKER)
        if states is None:
            time.sleep(0.05)
            return False
        quiet = quiet + 1 if all(state == "S" for state in states) else 0
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _thread_states(name: str) -> "list[str] | None":
    """The scheduler state (R running, S sleeping, ...) of each thread of this process
    named `name`; None where /proc/self/task is not there."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tasks:
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:  # the thread has ended
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm == name:
            states.append(stat[stat.rindex(")") + 2])
    return states
