"""The sweep: every architecture of a transformers task, tiny and random, through every
stage of autopar; one line per architecture, a summary table and JSON for CI trends.

    python -m autopar sweep [--task causal-lm] [--training] [--mesh 2,4] [--only a,b] [--ranks]
                            [--limit-s 120] [--json out.json]

Stages, in order; an architecture stops at the first that fails:

    config         the default config shrunk (tools/sweep_configs.py), the model built   } not autopar's
    single-device  forward (and backward with --training) on one device                  } failures
    export         torch.export, through autopar's trace: a TraceError quotes the exporter (counted apart)
    trace          autopar's own tracing steps after the export (functionalisation, signature checks)
    plan           strategies, costs and the ILP on the mesh (near-free communication, so it shards)
    simulate       every rank's program in the in-process mesh simulator against one device:
                   outputs and, with --training, every local parameter gradient (fp32 defaults
                   of torch.testing.assert_close; a difference there is re-checked in float64
                   at float64 tolerances, which tells rounding from a wrong program)
    ranks          (--ranks) the plan on real gloo ranks, autopar.verify

1. Each architecture runs in its own forked worker under a wall-clock limit (a hang or a
   crash is a row of the report, never the end of the sweep); the worker reports each
   stage as it starts, so a timeout names the stage it was in.
2. The worker times every stage and sends back one SweepResult.
3. The parent prints a line per architecture as it finishes, then sweep_report's summary() and
   to_json().
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Optional

import torch

from autopar.core.errors import TraceError
from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.cost_models.devices import DeviceSpec
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from autopar.tools.float64_check import float64_math, in_float64
from autopar.tools.simulated import CHEAP_COMM, Reference, reference_run, simulate_against
from autopar.tools.sweep_configs import Task, Tiny, architectures
from autopar.tools.sweep_ranks import Outcome, RankJob, RankResult, run_on_ranks


class Stage(Enum):
    CONFIG = "config"
    SINGLE_DEVICE = "single-device"
    EXPORT = "export"  # torch.export refused the model (autopar's TraceError quotes why)
    TRACE = "trace"  # autopar's own steps after torch.export (functionalisation, signature checks)
    PLAN = "plan"
    SIMULATE = "simulate"
    RANKS = "ranks"


NOT_AUTOPARS = (Stage.CONFIG, Stage.SINGLE_DEVICE)  # failures there are the model's or the shrink's


@dataclass(frozen=True)
class SweepOptions:
    task: Task = Task.CAUSAL_LM
    mesh: tuple[int, ...] = (2, 4)
    # training: the plan counts backward, the simulator compares every parameter gradient
    training: bool = False
    # also run every plan the simulator passed on prod(mesh) gloo ranks (autopar.verify),
    # after the simulator stage of every architecture, up to ranks_chunk in one set of ranks
    ranks: bool = False
    # wall-clock seconds per architecture, all stages together
    limit_s: float = 120.0
    batch: int = 4
    seq: int = 8
    # cost-model device for planning: CHEAP_COMM, or a preset name ("cpu", "h100", ...)
    device: "str | DeviceSpec" = CHEAP_COMM
    # the last stage to run (e.g. Stage.SINGLE_DEVICE to check the shrunk configs only)
    until: Stage = Stage.RANKS
    # workers running at once
    jobs: int = 1
    ranks_chunk: int = 24


@dataclass(frozen=True)
class SweepResult:
    arch: str  # transformers model_type
    model_class: str
    outcome: Outcome
    stage: Optional[Stage]  # where it stopped; None when it passed every stage it ran
    cause: str = ""  # first line(s) of the error or mismatch
    times_s: dict[str, float] = field(default_factory=dict)  # stage value -> seconds
    # stage value -> CPU seconds of the worker (one torch thread): what a stage costs
    # apart from what else the machine runs
    cpu_s: dict[str, float] = field(default_factory=dict)
    params: int = 0
    sharded_params: int = 0  # parameters the plan stores split on some mesh axis
    sharded_values: int = 0  # graph values (parameters, activations) split on some mesh axis
    # fp32 differed by rounding only: the float64 re-check matched (_simulate_in_float64)
    float64_only: bool = False
    ranks_float64_only: bool = False  # the same, on the ranks

    @property
    def category(self) -> str:
        """pass, config, single-device, export, plan, simulate-mismatch, simulate-error,
        ranks-mismatch, ranks-error, or timeout."""
        if self.outcome in (Outcome.PASS, Outcome.TIMEOUT) or self.stage is None:
            return self.outcome.value
        if self.stage in (Stage.SIMULATE, Stage.RANKS):
            return f"{self.stage.value}-{self.outcome.value}"
        return self.stage.value

    @property
    def against_autopar(self) -> bool:
        """A failure of autopar's own stages (export failures are counted apart)."""
        return self.outcome is not Outcome.PASS and self.stage not in NOT_AUTOPARS + (Stage.EXPORT,)

    def line(self) -> str:
        times = " ".join(f"{k} {v:.1f}s" for k, v in self.times_s.items())
        where = f" in {self.stage.value}" if self.outcome is Outcome.TIMEOUT and self.stage else ""
        where += " (float64)" if self.float64_only or self.ranks_float64_only else ""
        cause = f"  {self.cause.splitlines()[0][:160]}" if self.cause else ""
        return f"{self.arch:<26} {self.category + where:<24} {times}{cause}"


class _Stopped(Exception):
    def __init__(self, stage: Stage, outcome: Outcome, cause: str) -> None:
        super().__init__(cause)
        self.stage, self.outcome, self.cause = stage, outcome, cause


def _cause(e: BaseException, lines: int = 3) -> str:
    text = "\n".join(str(e).strip().splitlines()[:lines])
    return f"{type(e).__name__}: {text}"[:600]


def check_architecture(arch: str, model_class: str, options: SweepOptions,
                       on_stage: Callable[[Stage], None] = lambda s: None,
                       plan_path: Optional[str] = None) -> SweepResult:
    """Run one architecture through the stages up to the simulator in this process (the
    sweep calls it in a forked worker; tests may call it directly). A plan the simulator
    passed is saved at `plan_path`, for the ranks stage (sweep_ranks.py)."""
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}
    facts = {"params": 0, "sharded_params": 0, "sharded_values": 0, "float64_only": False}
    order = list(Stage)

    def reached(s: Stage) -> bool:  # options.until cuts the run short
        return order.index(s) <= order.index(options.until)

    def stage(s: Stage, fn: Callable[[], Any]) -> Any:
        on_stage(s)
        start, start_cpu = time.perf_counter(), time.process_time()
        try:
            return fn()
        except _Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a row of the report
            where = Stage.TRACE if s is Stage.EXPORT and not isinstance(e, TraceError) else s
            raise _Stopped(where, Outcome.ERROR, _cause(e)) from e
        finally:
            times[s.value] = round(time.perf_counter() - start, 3)
            cpu[s.value] = round(time.process_time() - start_cpu, 3)

    try:
        model, kwargs = stage(Stage.CONFIG, lambda: Tiny(arch, model_class, options.task, options.training, options.batch,
                                                       options.seq).build())
        facts["params"] = sum(p.numel() for p in model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if reached(Stage.SINGLE_DEVICE):
                ref = stage(Stage.SINGLE_DEVICE, lambda: reference_run(model, (), kwargs, options.training))
            if reached(Stage.EXPORT):
                traced = stage(Stage.EXPORT, lambda: trace(model, (), kwargs))
            if reached(Stage.PLAN):
                opts = Options(device=options.device, training=options.training)
                plan = stage(Stage.PLAN, lambda: plan_traced(traced, Mesh.of(options.mesh), opts)[1])
                split = [n for n in plan.nodes if n.outputs and not n.outputs[0].is_replicated()]
                facts["sharded_params"] = sum(n.kind is NodeKind.PARAMETER for n in split)
                facts["sharded_values"] = len(split)
            if reached(Stage.SIMULATE):
                facts["float64_only"] = stage(
                    Stage.SIMULATE, lambda: _simulate_and_compare(model, kwargs, traced, plan, ref, options))
            if plan_path is not None and reached(Stage.RANKS):
                plan.to_json(plan_path)
    except _Stopped as s:
        return SweepResult(arch, model_class, s.outcome, s.stage, s.cause, times, cpu, **facts)
    return SweepResult(arch, model_class, Outcome.PASS, None, "", times, cpu, **facts)


def _simulate_and_compare(model: torch.nn.Module, kwargs: dict, traced, plan, ref: Reference,
                          options: SweepOptions) -> bool:
    """Every simulated rank's outputs (and local gradient blocks) against the reference at
    fp32 tolerances; where they differ, the float64 re-check decides. True when only the
    float64 check matched."""
    try:
        simulate_against(model, (), kwargs, traced, plan, ref)
        return False
    except AssertionError as e:
        fp32 = _cause(e, 6)
    try:
        _simulate_in_float64(model, kwargs, options)
    except AssertionError as e:
        raise _Stopped(Stage.SIMULATE, Outcome.MISMATCH, f"{fp32}\nin float64 too: {_cause(e, 4)}") from None
    return True


def _simulate_in_float64(model: torch.nn.Module, kwargs: dict, options: SweepOptions) -> None:
    """An fp32 difference can be rounding: a sum split over ranks adds in another order, and
    a large gradient that is a sum of many terms (an embedding's) differs from one device
    by more than assert_close's fp32 rtol (1.3e-6) although the math is the same. The same
    model and inputs in float64, traced, planned and simulated again, must then match one
    device at float64's tolerances (rtol 1e-7, atol 1e-7: some 1e8 times the unit
    roundoff, far below any real mistake's size). The parts a model computes in float32
    whatever its dtype run in float64 too (float64_check.float64_math), on both sides."""
    model64, kwargs64 = in_float64(copy.deepcopy(model), kwargs)
    with float64_math():
        traced = trace(model64, (), kwargs64)
        plan = plan_traced(traced, Mesh.of(options.mesh), Options(device=options.device, training=options.training))[1]
        simulate_against(model64, (), kwargs64, traced, plan)


# ---- the sweep: one forked worker per architecture -----------------------------------

def _worker(arch: str, model_class: str, options: SweepOptions, plan_path: Optional[str], conn: Any) -> None:
    os.setpgid(0, 0)  # its own process group: a timeout ends the worker and the ranks it spawned
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    try:
        result = check_architecture(arch, model_class, options, on_stage=lambda s: conn.send(("stage", s)),
                                    plan_path=plan_path)
    except BaseException as e:  # noqa: BLE001 - the sweep's own bug still returns a row
        result = SweepResult(arch, model_class, Outcome.ERROR, None, f"sweep: {_cause(e)}")
    conn.send(("done", result))
    conn.close()


@dataclass
class _Running:
    arch: str
    model_class: str
    proc: Any
    conn: Any
    start: float
    stage: Optional[Stage] = None


def _kill(job: _Running) -> None:
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        job.proc.kill()
    job.proc.join()


def _poll(job: _Running, limit_s: float) -> Optional[SweepResult]:
    """The worker's result when it has finished (or run out of time), else None."""
    try:
        while job.conn.poll():
            kind, value = job.conn.recv()
            if kind == "stage":
                job.stage = value
            else:
                job.proc.join()
                return value
    except (EOFError, OSError):  # the worker died without a result (a crash in native code)
        job.proc.join()
        return SweepResult(job.arch, job.model_class, Outcome.ERROR, job.stage,
                           f"worker exited with code {job.proc.exitcode}")
    if time.monotonic() - job.start > limit_s:
        _kill(job)
        return SweepResult(job.arch, job.model_class, Outcome.TIMEOUT, job.stage, f"over {limit_s:g} s")
    return None


def sweep(options: SweepOptions, only: Optional[list[str]] = None,
          progress: Callable[[str], None] = print) -> list[SweepResult]:
    """Every architecture of options.task (or `only` those), each in a forked worker;
    with options.ranks, then every plan the simulator passed on gloo ranks."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="autopar-sweep-plans-") as plans:
        results = _simulated(options, only, progress, plans if options.ranks else None)
        if options.ranks and options.until is Stage.RANKS:
            results = _ranked(results, options, plans, progress)
    return results


def _simulated(options: SweepOptions, only: Optional[list[str]], progress: Callable[[str], None],
               plans: Optional[str]) -> list[SweepResult]:
    import transformers.modeling_utils  # noqa: F401 - loaded once here, inherited by every worker
    archs = architectures(options.task)
    if only:
        missing = [a for a in only if a not in archs]
        if missing:
            raise ValueError(f"not {options.task.value} architectures: {missing}")
        archs = {a: archs[a] for a in only}
    todo = list(archs.items())
    ctx = multiprocessing.get_context("fork")
    running: list[_Running] = []
    results: list[SweepResult] = []
    try:
        while todo or running:
            while todo and len(running) < options.jobs:
                arch, cls = todo.pop(0)
                parent, child = ctx.Pipe(duplex=False)
                plan_path = os.path.join(plans, f"{arch}.json") if plans else None
                proc = ctx.Process(target=_worker, args=(arch, cls, options, plan_path, child))
                proc.start()
                try:
                    os.setpgid(proc.pid, proc.pid)  # also here: whichever side runs first
                except (PermissionError, ProcessLookupError):
                    pass  # the worker already did (and exec'd nothing) or has ended
                child.close()
                running.append(_Running(arch, cls, proc, parent, time.monotonic()))
            for job in list(running):
                result = _poll(job, options.limit_s)
                if result is not None:
                    running.remove(job)
                    results.append(result)
                    progress(f"[{len(results):3d}/{len(archs)}] {result.line()}")
            time.sleep(0.05)
    finally:  # interrupted: end every worker still running (and its ranks)
        for job in running:
            _kill(job)
    order = list(archs)
    return sorted(results, key=lambda r: order.index(r.arch))


def _ranked(results: list[SweepResult], options: SweepOptions, plans: str,
            progress: Callable[[str], None]) -> list[SweepResult]:
    """`results` with the ranks stage of every architecture the simulator passed."""
    jobs = [RankJob(Tiny(r.arch, r.model_class, options.task, options.training, options.batch, options.seq),
                    os.path.join(plans, f"{r.arch}.json"))
            for r in results if r.outcome is Outcome.PASS and os.path.exists(os.path.join(plans, f"{r.arch}.json"))]
    world = Mesh.of(options.mesh).size
    progress(f"ranks: the {len(jobs)} plans the simulator passed, on {world} gloo ranks")
    count = iter(range(1, len(jobs) + 1))
    by_arch = {r.arch: r for r in results}
    done = run_on_ranks(jobs, options.mesh, options.limit_s, options.ranks_chunk,
                        progress=lambda rr: progress(f"[ranks {next(count):3d}/{len(jobs)}] "
                                                     f"{_with_ranks(by_arch[rr.arch], rr).line()}"))
    return [_with_ranks(r, done[r.arch]) if r.arch in done else r for r in results]


def _with_ranks(result: SweepResult, ranked: RankResult) -> SweepResult:
    passed = ranked.outcome is Outcome.PASS
    return replace(result, outcome=ranked.outcome, stage=None if passed else Stage.RANKS, cause=ranked.cause,
                   times_s={**result.times_s, Stage.RANKS.value: round(ranked.seconds, 3)},
                   ranks_float64_only=ranked.float64_only)
