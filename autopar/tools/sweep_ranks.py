"""The sweep's --ranks stage: the plans the simulator passed, run on prod(mesh) real gloo
ranks, many architectures in one set of ranks.

Every rank rebuilds the same tiny model (sweep_configs.Tiny, fixed seed) and runs
autopar.verify with the plan file the sweep's worker saved (or, without one, plans as a
user's job does: rank 0 traces, plans and ships), against its own single-device copy. Where fp32 differs on any rank, the simulator stage's float64 re-check decides
(sweep._simulate_in_float64): the same model in float64, planned again on the ranks, at
float64's tolerances.

1. The parent forks the ranks once for a chunk of architectures (a rank's start-up, torch
   and transformers, is paid once a chunk, not once an architecture).
2. Each rank marks every architecture as begun, then writes one report file for it.
3. The parent watches those files. Every rank reported: the architecture has its row, and
   the ranks go on. A rank reported an error, a rank exited, or the architecture ran past
   its limit: that row is written, every rank is killed (a failed collective leaves a
   process group unusable, so no rank goes on after one), and fresh ranks take the rest.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import _compat
from autopar.core.files import write_json_atomic
from autopar.tools.float64_check import float64_math, in_float64
from autopar.tools.simulated import CHEAP_COMM
from autopar.tools.sweep_configs import Tiny
from autopar.tools.verify import verify

# A chunk's first architecture also waits for the ranks to start (forked, so mostly the
# rendezvous and the first model's imports).
START_ALLOWANCE_S = 120.0


class Outcome(Enum):
    PASS = "pass"
    ERROR = "error"  # an exception
    MISMATCH = "mismatch"  # ran, but differs from one device
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class RankJob:
    tiny: Tiny
    # the plan the simulator passed, as plan.to_json wrote it; None: planned on the ranks
    # with near-free communication, as the sweep plans
    plan_path: Optional[str] = None


@dataclass(frozen=True)
class RankResult:
    arch: str
    outcome: Outcome
    seconds: float  # wall-clock, from the ranks beginning it to the last report
    cause: str = ""  # the first failing rank's report, "rank r: ..."
    float64_only: bool = False  # fp32 missed the tolerance on some rank, float64 matched


def run_on_ranks(jobs: list[RankJob], mesh: tuple[int, ...], limit_s: float, chunk: int = 24,
                 progress: Callable[[RankResult], None] = lambda r: None) -> dict[str, RankResult]:
    """arch -> its result on prod(mesh) gloo ranks, for every job; at most `chunk`
    architectures share one set of ranks, each under `limit_s` wall-clock seconds."""
    results: dict[str, RankResult] = {}
    todo = list(jobs)
    def done(result: RankResult) -> None:
        results[result.arch] = result
        progress(result)

    while todo:
        _run_batch(todo[:chunk], mesh, limit_s, done)
        todo = [j for j in todo if j.tiny.arch not in results]
    return results


# ---- the parent: one set of ranks over a batch ---------------------------------------

def _run_batch(batch: list[RankJob], mesh: tuple[int, ...], limit_s: float, done: Callable[[RankResult], None]) -> None:
    """`done` with each result, as it comes, for a prefix of `batch`: all of it, or up to
    and including the first architecture that failed in a way that ends the ranks (at
    least one)."""
    world = 1
    for size in mesh:
        world *= size
    with tempfile.TemporaryDirectory(prefix="autopar-sweep-ranks-") as tmp:
        ctx = mp.start_processes(_rank_main, args=(world, tmp, batch, mesh, limit_s), nprocs=world, join=False,
                                 start_method="fork")
        try:
            _watch(ctx, tmp, batch, world, limit_s, done)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()


def _watch(ctx, tmp: str, batch: list[RankJob], world: int, limit_s: float,
           done: Callable[[RankResult], None]) -> None:
    began = time.monotonic()
    limit = limit_s + START_ALLOWANCE_S
    for index, job in enumerate(batch):
        arch = job.tiny.arch
        while True:
            reports = [_read(tmp, index, r) for r in range(world)]
            failed = next((r for r, rep in enumerate(reports) if rep and rep["outcome"] == Outcome.ERROR.value), None)
            if failed is not None:
                done(RankResult(arch, Outcome.ERROR, time.monotonic() - began,
                                f"rank {failed}: {reports[failed]['report']}"))
                return
            if all(reports):
                worst = next((r for r, rep in enumerate(reports) if rep["outcome"] != Outcome.PASS.value), None)
                cause = f"rank {worst}: {reports[worst]['report']}" if worst is not None else ""
                outcome = Outcome.PASS if worst is None else Outcome(reports[worst]["outcome"])
                done(RankResult(arch, outcome, time.monotonic() - began, cause,
                                any(rep["float64"] for rep in reports)))
                break
            dead = next((r for r, p in enumerate(ctx.processes) if p.exitcode is not None), None)
            if dead is not None and not _read(tmp, index, dead):
                code = ctx.processes[dead].exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                done(RankResult(arch, Outcome.ERROR, time.monotonic() - began, f"rank {dead} {how} without a report"))
                return
            if time.monotonic() - began > limit:
                begun = [r for r in range(world) if os.path.exists(_path(tmp, index, r, "begun"))]
                done(RankResult(arch, Outcome.TIMEOUT, time.monotonic() - began,
                                f"over {limit:g} s; ranks without a report: "
                                f"{[r for r in range(world) if not reports[r]]}, begun: {begun}"))
                return
            time.sleep(0.1)
        began, limit = time.monotonic(), limit_s


def _path(tmp: str, index: int, rank: int, what: str) -> str:
    return os.path.join(tmp, f"{index:04d}.rank{rank}.{what}")


def _read(tmp: str, index: int, rank: int) -> Optional[dict]:
    path = _path(tmp, index, rank, "json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# ---- a rank ---------------------------------------------------------------------------

def _rank_main(rank: int, world: int, tmp: str, batch: list[RankJob], mesh: tuple[int, ...], limit_s: float) -> None:
    _compat.report_fatal_signals()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=limit_s))
    except Exception:  # noqa: BLE001 - the first architecture's row says why
        write_json_atomic(_path(tmp, 0, rank, "json"), _report(Outcome.ERROR, traceback.format_exc()[-1500:]))
        return
    for index, job in enumerate(batch):
        open(_path(tmp, index, rank, "begun"), "w").close()
        try:
            report = _verify(job, mesh, limit_s)
        except Exception as e:  # noqa: BLE001 - reported; the parent ends these ranks
            said = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            write_json_atomic(_path(tmp, index, rank, "json"),
                              _report(Outcome.ERROR, f"{said}\n{traceback.format_exc()[-1500:]}"))
            return
        write_json_atomic(_path(tmp, index, rank, "json"), report)
    dist.destroy_process_group()


def _verify(job: RankJob, mesh: tuple[int, ...], limit_s: float) -> dict:
    tiny = job.tiny
    grad = torch.enable_grad() if tiny.training else torch.no_grad()
    with warnings.catch_warnings(), grad:
        warnings.simplefilter("ignore")
        model, kwargs = tiny.build()
        planning = {"plan": job.plan_path} if job.plan_path else {"device": CHEAP_COMM, "training": tiny.training}
        report = verify(model, (), kwargs, mesh=mesh, collective_timeout_s=limit_s, **planning)
        every = torch.tensor([int(report.ok)])
        dist.all_reduce(every, op=dist.ReduceOp.MIN)
        if every.item():
            return _report(Outcome.PASS, str(report))
        model, kwargs = in_float64(*tiny.build())
        with float64_math():
            again = verify(model, (), kwargs, mesh=mesh, device=CHEAP_COMM, training=tiny.training,
                           rtol=1e-7, atol=1e-7, collective_timeout_s=limit_s)
    text = f"fp32: {report}\nfloat64: {again}"
    return _report(Outcome.PASS if again.ok else Outcome.MISMATCH, text, float64=True)


def _report(outcome: Outcome, text: str, float64: bool = False) -> dict:
    return {"outcome": outcome.value, "report": text, "float64": float64}

