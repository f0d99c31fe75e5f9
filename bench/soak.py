"""Many short multi-rank torchrun jobs, counted by how each ended.

    python bench/soak.py --minutes 60 [--jobs N] [--parallel 2] [--load 0] [--ranks 2,4]
                         [--kinds train,pipeline,...] [--malloc-check] [--destroy] [--keep DIR]

Each job is bench/soak_job.py under `torchrun --standalone` (2 to 8 gloo ranks, one
torch thread each), compared there with one device. A job ends as one of:

    ok              exit 0, every rank wrote its result, every result matched
    mismatch        every rank wrote its result, some differ from one device
    abort at exit   every rank wrote a matching result, and the job still exited non-zero
                    (an abort in teardown: "terminate called ...", a signal)
    failed          a rank exited non-zero before writing its result
    hang            the job outlived --job-timeout and was killed

--parallel runs that many jobs at once (the machine kept busy, as a cluster node shared
with other jobs is); --load adds busy-looping processes beside them. --malloc-check sets
MALLOC_CHECK_=3 and MALLOC_PERTURB_ in every rank, so glibc aborts at the first heap
inconsistency; every rank runs with PYTHONFAULTHANDLER=1, so a signal prints each
thread's Python stack. The log of every job that did not end ok is kept under --keep,
and the last lines print the counts per kind and per outcome:

    soak: 120 jobs in 60.1 min: ok 120, mismatch 0, abort at exit 0, failed 0, hang 0

Run a long soak from a clone, so that edits to the working tree do not reach its jobs; with
an editable install, also put bench/isolate on PYTHONPATH and name the clone in
AUTOPAR_ROOT (bench/isolate/sitecustomize.py says why).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# kind -> world sizes it cycles through
WORLDS = {"train": (2, 4, 8), "checkpoint": (2, 4), "pipeline": (4,), "generate": (2,), "compile": (2,),
          "mixed": (2, 8)}
DEFAULT_KINDS = ("train", "checkpoint", "pipeline", "generate", "mixed")
OUTCOMES = ("ok", "mismatch", "abort at exit", "failed", "hang")
# what an abnormal job's log says, first match wins
SIGNS = (("heap", re.compile(r"malloc\(\)|free\(\)|corrupted|double free|chunk")),
         ("terminate", re.compile(r"terminate called")),
         ("segfault", re.compile(r"Segmentation fault|SIGSEGV")),
         ("abort", re.compile(r"SIGABRT|Aborted|Fatal Python error")),
         ("peer closed", re.compile(r"Connection closed by peer|Connection reset")),
         ("timeout", re.compile(r"[Tt]imed? ?out")))


@dataclass(frozen=True)
class Job:
    number: int
    kind: str
    world: int


@dataclass(frozen=True)
class Ended:
    job: Job
    outcome: str
    sign: str
    seconds: float
    log: str


def _schedule(kinds: tuple[str, ...], ranks: tuple[int, ...] = ()) -> Iterator[Job]:
    cycles = {k: itertools.cycle(ranks or WORLDS[k]) for k in kinds}
    for n, kind in zip(itertools.count(), itertools.cycle(kinds)):
        yield Job(n, kind, next(cycles[kind]))


def _start(job: Job, work: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str, float]:
    out = os.path.join(work, f"job{job.number}")
    os.makedirs(out)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if args.malloc_check:
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job.world}",
           os.path.join(HERE, "soak_job.py"), job.kind, "--out", out] + (["--destroy"] if args.destroy else [])
    log = open(os.path.join(out, "log.txt"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    log.close()
    return proc, out, time.monotonic()


def _verdict(job: Job, out: str, rc: Optional[int], seconds: float) -> Ended:
    log_path = os.path.join(out, "log.txt")
    text = open(log_path, errors="replace").read()
    results = []
    for r in range(job.world):
        path = os.path.join(out, f"rank{r}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    if rc is None:
        outcome = "hang"
    elif any(r is None for r in results):
        outcome = "failed"
    elif not all(r["match"] for r in results):
        outcome = "mismatch"
    else:
        outcome = "ok" if rc == 0 else "abort at exit"
    sign = "" if outcome == "ok" else next((name for name, pattern in SIGNS if pattern.search(text)), "other")
    return Ended(job, outcome, sign, seconds, log_path)


def _load(n: int) -> list[subprocess.Popen]:
    spin = "import time\nwhile True: sum(i * i for i in range(10000))"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def soak(args: argparse.Namespace) -> list[Ended]:
    kinds = tuple(args.kinds.split(","))
    unknown = set(kinds) - set(WORLDS)
    if unknown:
        raise SystemExit(f"soak: unknown kinds {sorted(unknown)}; choose from {sorted(WORLDS)}")
    work = tempfile.mkdtemp(prefix="autopar-soak-")
    deadline = time.monotonic() + args.minutes * 60
    jobs = _schedule(kinds, tuple(int(r) for r in args.ranks.split(",")) if args.ranks else ())
    running: list[tuple[Job, subprocess.Popen, str, float]] = []
    ended: list[Ended] = []
    spinners = _load(args.load)
    try:
        _run(jobs, running, ended, deadline, work, args)
    except KeyboardInterrupt:  # the jobs so far still count
        print("soak: interrupted; the jobs still running are not counted", flush=True)
    finally:
        for proc in spinners:
            proc.kill()
        for _, proc, _, _ in running:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    return ended


def _run(jobs: Iterator[Job], running: list, ended: list[Ended], deadline: float, work: str,
         args: argparse.Namespace) -> None:
    """Keep --parallel jobs running until the deadline (or --jobs), judging each as it ends."""
    def more() -> bool:
        return time.monotonic() < deadline and (args.jobs is None or len(ended) + len(running) < args.jobs)

    while running or more():
        while len(running) < args.parallel and more():
            job = next(jobs)
            running.append((job, *_start(job, work, args)))
        time.sleep(0.5)
        for item in list(running):
            job, proc, out, t0 = item
            rc = proc.poll()
            timed_out = rc is None and time.monotonic() - t0 > args.job_timeout
            if rc is None and not timed_out:
                continue
            if timed_out:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            running.remove(item)
            end = _verdict(job, out, None if timed_out else rc, time.monotonic() - t0)
            ended.append(end)
            _report(end, args.keep)
            shutil.rmtree(out, ignore_errors=True)


def _report(end: Ended, keep: Optional[str]) -> None:
    j = end.job
    line = f"job {j.number:4d} {j.kind:10s} {j.world} ranks {end.seconds:6.1f} s  {end.outcome}"
    if end.outcome != "ok":
        line += f" ({end.sign})"
        if keep:
            os.makedirs(keep, exist_ok=True)
            kept = os.path.join(keep, f"job{j.number}-{j.kind}-{j.world}.log")
            shutil.copy(end.log, kept)
            line += f" log {kept}"
    print(line, flush=True)


def summary(ended: list[Ended], minutes: float) -> str:
    lines = []
    for kind in sorted({e.job.kind for e in ended}):
        mine = [e for e in ended if e.job.kind == kind]
        counts = collections.Counter(e.outcome for e in mine)
        lines.append(f"  {kind:10s} {len(mine):4d} jobs: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES))
    signs = collections.Counter((e.outcome, e.sign) for e in ended if e.outcome != "ok")
    if signs:
        lines.append("  abnormal by sign: " + ", ".join(f"{o} ({s}) {n}" for (o, s), n in sorted(signs.items())))
    total = collections.Counter(e.outcome for e in ended)
    lines.append(f"soak: {len(ended)} jobs in {minutes:.1f} min: " + ", ".join(f"{o} {total[o]}" for o in OUTCOMES))
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=None, help="stop after this many jobs")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma-separated, of {sorted(WORLDS)}")
    parser.add_argument("--ranks", default="", help="comma-separated world sizes every kind cycles through "
                        "(default: each kind's own, 2 to 8)")
    parser.add_argument("--parallel", type=int, default=2, help="jobs at once")
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes beside the jobs")
    parser.add_argument("--job-timeout", type=float, default=300.0, help="seconds before a job counts as a hang")
    parser.add_argument("--malloc-check", action="store_true")
    parser.add_argument("--destroy", action="store_true", help="jobs call destroy_process_group themselves")
    parser.add_argument("--keep", default=None, help="folder for the logs of jobs that did not end ok")
    args = parser.parse_args()
    # a background job's SIGINT is ignored, and a scheduler stops a job with SIGTERM: both
    # end the soak as Ctrl-C does, with the counts so far
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    t0 = time.monotonic()
    ended = soak(args)
    print(summary(ended, (time.monotonic() - t0) / 60))


if __name__ == "__main__":
    main()
