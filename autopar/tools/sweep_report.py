"""The sweep's report: counts by category, per-stage times, the summary a person reads and
the JSON a script reads (autopar/tools/sweep.py makes the results)."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from autopar.core.mesh import Mesh
from autopar.tools.sweep import NOT_AUTOPARS, Stage, SweepOptions, SweepResult
from autopar.tools.sweep_ranks import Outcome


CATEGORIES = ("pass", "config", "single-device", "export", "trace", "plan", "simulate-mismatch", "simulate-error",
              "ranks-mismatch", "ranks-error", "timeout", "error")


def stage_times(results: list[SweepResult], cpu: bool = False) -> dict[str, tuple[float, float, str]]:
    """stage -> (median s, max s, the slowest architecture), over the runs that finished it;
    `cpu`: CPU seconds instead of wall-clock."""
    out = {}
    for s in Stage:
        done = [((r.cpu_s if cpu else r.times_s)[s.value], r.arch) for r in results
                if s.value in (r.cpu_s if cpu else r.times_s) and not (r.stage is s and r.outcome is not Outcome.PASS)]
        if done:
            worst = max(done)
            out[s.value] = (statistics.median(t for t, _ in done), worst[0], worst[1])
    return out


def summary(results: list[SweepResult], options: SweepOptions) -> str:
    counts = {c: sum(r.category == c for r in results) for c in CATEGORIES}
    mode = "training" if options.training else "inference"
    lines = [f"sweep {options.task.value} on mesh {options.mesh}, {mode}: {len(results)} architectures", "",
             f"{'stage reached / stopped at':<28} {'count':>5}"]
    lines += [f"  {c:<26} {n:5d}" for c, n in counts.items() if n]
    mine = [r for r in results if r.against_autopar]
    theirs = sum(r.stage in NOT_AUTOPARS for r in results if r.outcome is not Outcome.PASS)
    exported = [r for r in results if r.outcome is Outcome.PASS or r.against_autopar]
    lines += ["", f"not autopar's (config, single-device): {theirs}; torch.export failures: {counts['export']}"]
    if any(Stage.EXPORT.value in r.times_s for r in results):
        simulated = sum(r.outcome is Outcome.PASS or r.stage is Stage.RANKS for r in results)
        lines.append(f"autopar: {simulated} of {len(exported)} exported architectures pass the simulator")
    if any(Stage.RANKS.value in r.times_s for r in results):
        ranked = [r for r in results if Stage.RANKS.value in r.times_s]
        passed = sum(r.outcome is Outcome.PASS for r in ranked)
        lines.append(f"on {Mesh.of(options.mesh).size} gloo ranks: {passed} of the {len(ranked)} the simulator "
                     f"passed ({100 * passed / len(ranked):.1f} %)")
    lines += ["", f"{'stage':<16} {'median s':>9} {'max s':>8}  slowest     (CPU s: median, max, slowest)"]
    by_cpu = stage_times(results, cpu=True)
    for s, (med, worst, arch) in stage_times(results).items():
        c = by_cpu.get(s)
        lines.append(f"  {s:<14} {med:9.2f} {worst:8.2f}  {arch:<20}" + (f" {c[0]:6.2f} {c[1]:6.2f}  {c[2]}" if c else ""))
    if mine:
        lines += ["", "failures counted against autopar:"]
        lines += [f"  {r.arch:<24} {r.category:<18} {r.cause.splitlines()[0][:200] if r.cause else ''}"
                  for r in mine]
    planned = [r for r in results if r.outcome is Outcome.PASS and Stage.PLAN.value in r.times_s]
    whole = [r.arch for r in planned if not r.sharded_values]
    data_parallel = [r.arch for r in planned if r.sharded_values and not r.sharded_params]
    if whole:
        lines += ["", f"passed with every value replicated (the simulator checked one device's program): "
                      f"{', '.join(whole)}"]
    if data_parallel:
        lines += ["", f"passed with every parameter whole (activations split): {', '.join(data_parallel)}"]
    rounding = [r.arch for r in planned if r.float64_only]
    if rounding:
        lines += ["", f"passed in float64 after an fp32 rounding difference: {', '.join(rounding)}"]
    rounding = [r.arch for r in planned if r.ranks_float64_only]
    if rounding:
        lines += ["", f"on ranks, passed in float64 after an fp32 rounding difference: {', '.join(rounding)}"]
    return "\n".join(lines)


def to_json(results: list[SweepResult], options: SweepOptions) -> dict:
    import transformers
    opts = {**asdict(options), "task": options.task.value, "until": options.until.value,
            "device": options.device if isinstance(options.device, str) else options.device.name}
    rows = [{**asdict(r), "outcome": r.outcome.value, "stage": r.stage.value if r.stage else None,
             "category": r.category} for r in results]
    return {"torch": torch.__version__, "transformers": transformers.__version__, "options": opts,
            "counts": {c: sum(r.category == c for r in results) for c in CATEGORIES},
            "stage_times_s": {s: {"median": m, "max": x, "slowest": a} for s, (m, x, a) in
                              stage_times(results).items()},
            "results": rows}
