"""The full sweep: every architecture of transformers' auto mappings for each task, tiny
configs with random weights, through export, planning on mesh (2, 4) and the in-process
mesh simulator against one device (autopar/tools/sweep.py; one forked worker per
architecture under a time limit).

    python bench/sweep.py [--tasks causal-lm,masked-lm,seq2seq,image-classification,speech]
                          [--training] [--mesh 2,4] [--limit-s 300] [--jobs 1] [--ranks]
                          [--json sweep.json]

Prints one line per architecture as it finishes, then per task the summary table
(counts per stage, failures counted against autopar with their causes, per-stage
median/max seconds), and a last table over all tasks. Goal for planning a tiny model:
median under 3 s, none over 10 s. The JSON (one object per task) is for CI trends.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from autopar.core.files import write_json_atomic  # noqa: E402
from autopar.tools.simulated import CHEAP_COMM  # noqa: E402
from autopar.tools.sweep import SweepOptions, sweep  # noqa: E402
from autopar.tools.sweep_report import CATEGORIES, summary, to_json  # noqa: E402
from autopar.tools.sweep_configs import Task  # noqa: E402

PLAN_MEDIAN_GOAL_S, PLAN_MAX_GOAL_S = 3.0, 10.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(t.value for t in Task),
                    help="comma-separated tasks (default: all, causal-lm first)")
    ap.add_argument("--training", action="store_true", help="plan training; compare every gradient")
    ap.add_argument("--mesh", default="2,4")
    ap.add_argument("--limit-s", type=float, default=300.0, help="seconds per architecture")
    ap.add_argument("--jobs", type=int, default=1, help="architectures at once")
    ap.add_argument("--ranks", action="store_true", help="also run each plan on real gloo ranks")
    ap.add_argument("--only", help="comma-separated model types (with a single task)")
    ap.add_argument("--json", help="write every task's results here")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    mesh = tuple(int(x) for x in args.mesh.split(","))
    tasks = [Task(t) for t in args.tasks.split(",")]
    report, failing = {}, False
    for task in tasks:
        options = SweepOptions(task, mesh, args.training, args.ranks, args.limit_s, device=CHEAP_COMM, jobs=args.jobs)
        print(f"== {task.value}", flush=True)
        results = sweep(options, args.only.split(",") if args.only else None,
                        progress=lambda line: print(line, flush=True))
        print()
        print(summary(results, options))
        print()
        report[task.value] = to_json(results, options)
        failing |= any(r.against_autopar for r in results)
    print(_overall(report))
    if args.json:
        write_json_atomic(args.json, report)
        print(f"wrote {args.json}")
    return 1 if failing else 0


def _overall(report: dict) -> str:
    """One row per task: counts per category, planning time against the goal, and where
    the ranks ran, the simulator's pass rate beside the ranks'."""
    shown = [c for c in CATEGORIES if any(r["counts"][c] for r in report.values())]
    width = {c: len(c) + 2 for c in shown}
    lines = [f"{'task':<22}" + "".join(f"{c:>{width[c]}}" for c in shown) + f"{'plan med s':>12}{'plan max s':>12}"]
    for task, r in report.items():
        plan = r["stage_times_s"].get("plan", {"median": float("nan"), "max": float("nan")})
        lines.append(f"{task:<22}" + "".join(f"{r['counts'][c]:>{width[c]}}" for c in shown)
                     + f"{plan['median']:12.2f}{plan['max']:12.2f}")
    lines.append(f"planning goal: median under {PLAN_MEDIAN_GOAL_S:g} s, none over {PLAN_MAX_GOAL_S:g} s")
    if any(r["options"]["ranks"] for r in report.values()):
        lines += ["", rank_table(report)]
    return "\n".join(lines)


def rank_table(report: dict) -> str:
    """Per task: architectures autopar traced, how many of them pass the simulator, how
    many of those pass on real gloo ranks, and each rank failure in one line."""
    head = f"{'task':<22}{'mode':<11}{'exported':>9}{'simulator':>11}{'on ranks':>10}{'ranks / simulator':>19}"
    lines, failures = [head], []
    for task, r in report.items():
        rows = r["results"]
        exported = [x for x in rows if x["outcome"] == "pass" or x["stage"] in ("trace", "plan", "simulate", "ranks")]
        simulated = [x for x in exported if x["outcome"] == "pass" or x["stage"] == "ranks"]
        ranked = [x for x in simulated if x["outcome"] == "pass"]
        share = f"{100 * len(ranked) / len(simulated):.1f} %" if simulated else "-"
        mode = "training" if r["options"]["training"] else "inference"
        lines.append(f"{task:<22}{mode:<11}{len(exported):>9}{len(simulated):>11}{len(ranked):>10}{share:>19}")
        failures += [f"  {task} {x['arch']}: {x['category']}: {_gist(x['cause'])}" for x in simulated
                     if x["outcome"] != "pass"]
    return "\n".join(lines + (["", "failures on ranks:"] + failures if failures else []))


def _gist(cause: str) -> str:
    """A failure's one line: which rank, and the exception a traceback ends with."""
    lines = [line.strip() for line in cause.splitlines() if line.strip()]
    if not lines:
        return ""
    where = lines[0].split(":")[0] if lines[0].startswith("rank ") else ""
    said = lines[-1] if "Traceback" in cause else lines[0]
    return f"{where}: {said}"[:200] if where and not said.startswith(where) else said[:200]


if __name__ == "__main__":
    sys.exit(main())
