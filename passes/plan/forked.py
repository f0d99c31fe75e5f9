"""Independent planning jobs in forked worker processes, one per free core.

    plans = map_forked(plan_stage, range(stages))   # plan_stage(0), plan_stage(1), ... in order
    with started(plan_plain) as plain:                # plan_plain() begun in a worker
        ...                                           # other work here meanwhile
        outcome = plain()                             # its Plan, or the exception it raised

A pipeline's stages are traced and solved independently of each other (each its own
torch.export and its own ILP), and both are mostly Python: threads would take turns on
one interpreter lock, processes run side by side. The workers are forked, so they
inherit what the caller built (the model split into stage modules, the options) and
only each job's item goes to them and its picklable result (a Plan) comes back.

Every job is deterministic and independent, so the results are those of a loop running
them one after another, and so is a failure: the first job, in order, that fails is
raised (its exception pickled back), the jobs after it cancelled. Where the platform
does not fork (macOS spawns, Windows has no fork), where one core is free or there is one
job, in a daemonic process (a multiprocessing pool's worker may not have children) and
where CUDA is initialised (a forked child cannot use it), the loop runs here instead
(and `started` runs its job when its outcome is first asked for).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

# the job function the forked workers run: set before they fork, read in them by index
_JOB: Optional[Callable[[Any], Any]] = None


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def forks() -> bool:
    """Whether jobs may run in forked processes here: Linux, more than one core, not a
    daemonic process, and CUDA not initialised (a forked child cannot use its parent's
    CUDA context, and tracing a model on the GPU would)."""
    return (sys.platform.startswith("linux") and usable_cores() > 1 and not multiprocessing.current_process().daemon
            and not torch.cuda.is_initialized())


def map_forked(job: Callable[[Any], Any], items: Iterable[Any], workers: Optional[int] = None) -> list[Any]:
    """[job(item) for item in items], the jobs in forked workers (at most `workers`, or
    one per usable core) where forks() allows and there is more than one job."""
    items = list(items)
    count = min(len(items), workers or usable_cores())
    if count < 2 or not forks():
        return [job(item) for item in items]
    global _JOB
    _JOB = job
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a process with threads
            with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = [pool.submit(_run, item) for item in items]
                try:
                    return [f.result() for f in futures]
                finally:
                    for f in futures:
                        f.cancel()
    finally:
        _JOB = None


def _run(item: Any) -> Any:
    """One job in a worker, on one torch thread: a parent's OpenMP thread pool does not
    survive the fork (an op entering a parallel region in the child waits forever on
    threads it does not have), and the workers are already one per core."""
    assert _JOB is not None, "map_forked's job is set before its workers fork"
    torch.set_num_threads(1)
    return _JOB(item)


@contextmanager
def started(job: Callable[[], Any]) -> Iterator[Callable[[], Any]]:
    """job() begun in a forked worker where forks() allows, while the caller goes on; yields
    a function that waits for its outcome: what job() returned, or the exception it raised
    (returned, not raised). Elsewhere job() runs when its outcome is first asked for. On
    leaving, a worker still running is stopped."""
    if not forks():
        yield functools.cache(lambda: outcome_of(job))
        return
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    global _JOB
    _JOB = job
    try:
        worker = context.Process(target=_send_outcome, args=(send,), name="autopar-plan")
        worker.start()
    finally:
        _JOB = None
        send.close()

    @functools.cache
    def outcome() -> Any:
        try:
            value = receive.recv()
        except EOFError:
            value = RuntimeError(f"autopar's forked planning worker ended without a result (exit code "
                                 f"{worker.exitcode}); plan again, or on a platform without fork")
        worker.join()
        return value
    try:
        yield outcome
    finally:
        if worker.is_alive():
            worker.terminate()
        worker.join()
        receive.close()


def outcome_of(job: Callable[[], Any]) -> Any:
    """What job() returns, or the exception it raises (returned)."""
    try:
        return job()
    except Exception as e:  # noqa: BLE001 - handed to the caller, which decides
        return e


def raised(outcome: Any) -> Any:
    """An outcome (outcome_of, started): its value, or its exception raised."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _send_outcome(send: Any) -> None:
    """The forked worker of `started`: _JOB's outcome through the pipe (an exception that
    cannot be pickled as a RuntimeError with its words)."""
    torch.set_num_threads(1)  # as _run
    assert _JOB is not None, "started's job is set before its worker forks"
    value = outcome_of(_JOB)
    try:
        send.send(value)
    except Exception:  # noqa: BLE001 - a result or exception pickle refuses
        send.send(RuntimeError(f"{type(value).__name__}: {value}"))
    finally:
        send.close()
