"""Planning time and memory as models grow, on the meta device (no weights), training,
h100 preset. Planning time is autopar.plan end to end: trace, strategies, ILP build and
solve, plan read-back (and for a pipeline, the split and every stage's own plan).

    python bench/plan_scaling.py [--repeats 3] [--cluster inner|all|off] [--skip-70b] [--skip-405b] [--skip-dsv3]
                                 [--skip-long]

1. The GPT-2 small shape at 12, 24 and 48 layers and the Llama-3-8B shape (32 layers,
   hidden 4096, 32/8 heads, vocab 128256) on mesh (2, 4), batch 8 x 512: the median of
   --repeats runs with the ILP's size; 'growth 12->48 layers' (goal <= 4x; issue goal for
   the 8B shape: under 5 s).
2. Once each (the slowest): the Llama-3-70B shape (80 layers, hidden 8192, 64/8 heads) on
   (4, 8) over 4 nodes, pipeline_axis="auto", 8 microbatches (goal under 15 s); the
   Llama-3.1-405B shape (126 layers, hidden 16384, FFN 53248, 128/8 heads) on (8, 8, 8)
   over 64 nodes, batch 16 x 8192, pipeline axis 0, 16 microbatches under 1F1B, bf16
   compute, a 70 GiB budget (goal: a plan that fits, under 60 s and 8 GB); the
   DeepSeek-V3 shape (transformers' DeepseekV3Config defaults: 61 layers, hidden 7168,
   256 routed experts, top-8, MLA) on (32, 8) over 32 nodes, batch 32 x 4096, bf16, 70 GiB
   (goal under 60 s); the Llama-3-8B shape at 131072 tokens (batch 1, bf16, 70 GiB) on (8,)
   and on (8, 8) over 8 nodes (goal: proven optimal in under 60 s). These three return their
   logits split (Options.sharded_outputs): whole on every rank they alone are about 63 GiB
   (32 x 4096 x 129280 and 131072 x 128256 fp32 values), which plans count since 2370506.

Every shape is planned in a process of its own, so each row's peak memory is that shape's
alone: the largest resident set of that process, plus, where it planned pipeline stages in
forked workers (passes/plan/forked.py), the largest worker's times the workers that run at
once (one per usable core): a bound on all of them together. The last lines give each shape's
seconds and peak memory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.passes.plan.forked import usable_cores  # noqa: E402
from autopar.tools.zoo import build  # noqa: E402

SHAPES = (("gpt2-small", {"n_layer": 12}, "GPT-2 12L"), ("gpt2-small", {"n_layer": 24}, "GPT-2 24L"),
          ("gpt2-small", {"n_layer": 48}, "GPT-2 48L"), ("llama3-8b", {}, "Llama-3-8B"))
LLAMA3_70B = dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                  num_key_value_heads=8)
LLAMA31_405B = dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                    num_key_value_heads=8)


def plan_flat(name: str, overrides: dict, cluster: str) -> tuple[float, autopar.Plan]:
    model, args, kwargs = build(name, batch=8, seq=512, training=True, device="meta", **overrides)
    t = time.perf_counter()
    plan = autopar.plan(model, args, kwargs, mesh=(2, 4), device="h100", cluster_layers=cluster)
    return time.perf_counter() - t, plan


def plan_70b() -> tuple[float, autopar.Plan]:
    model, args, kwargs = build("llama3-8b", batch=8, seq=512, training=True, device="meta", **LLAMA3_70B)
    t = time.perf_counter()
    plan = autopar.plan(model, args, kwargs, mesh=(4, 8), device="h100", nodes=4, pipeline_axis="auto",
                        microbatches=8)
    return time.perf_counter() - t, plan


def plan_405b() -> tuple[float, autopar.Plan]:
    model, args, kwargs = build("llama3-8b", batch=16, seq=8192, training=True, device="meta", **LLAMA31_405B)
    t = time.perf_counter()
    plan = autopar.plan(model, args, kwargs, mesh=(8, 8, 8), device="h100", nodes=64, pipeline_axis=0,
                        microbatches=16, param_dtype=torch.bfloat16, memory_budget_bytes=70 * 2**30)
    return time.perf_counter() - t, plan


def plan_dsv3() -> tuple[float, autopar.Plan]:
    import transformers
    config = transformers.DeepseekV3Config(use_cache=False, max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (32, 4096), device="meta")
    t = time.perf_counter()
    plan = autopar.plan(model, (), {"input_ids": ids, "labels": ids}, mesh=(32, 8), device="h100", nodes=32,
                        param_dtype=torch.bfloat16, memory_budget_bytes=70 * 2**30, sharded_outputs=True)
    return time.perf_counter() - t, plan


def plan_long(shape: tuple[int, ...], nodes: int) -> tuple[float, autopar.Plan]:
    model, args, kwargs = build("llama3-8b", batch=1, seq=131072, training=True, device="meta")
    t = time.perf_counter()
    plan = autopar.plan(model, args, kwargs, mesh=shape, device="h100", nodes=nodes, param_dtype=torch.bfloat16,
                        memory_budget_bytes=70 * 2**30, sharded_outputs=True)
    return time.perf_counter() - t, plan


def _row(job: tuple) -> dict:
    """One shape planned in this (fresh) process: seconds, the plan's figures, peak RSS."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    kind, a = job[0], job[1:]
    seconds, plan = {"flat": plan_flat, "70b": plan_70b, "405b": plan_405b, "dsv3": plan_dsv3,
                     "long": plan_long}[kind](*a)
    p, s = plan.pipeline, plan.solver
    reports = [sp.solver for sp in plan.stage_plans] or [s]  # a pipeline: each stage's own solve
    gaps = [r.gap for r in reports if r.gap is not None]
    return {"seconds": seconds, "step_ms": plan.total_s * 1e3, "memory_gib": plan.memory_bytes / 2**30,
            "variables": s.variables, "constraints": s.constraints, "shared": s.shared_blocks, "status": s.status,
            "gap": max(gaps) if gaps else None, "stage_status": ", ".join(sorted({r.status for r in reports})),
            "chose": f"pipeline axis {p.axis}, {len(p.stages)} stages" if p is not None else "no pipeline",
            "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def _child(job: tuple, queue: Any) -> None:
    try:
        row = _row(job)
    except BaseException as e:  # the parent reports it and goes on to the next shape
        queue.put({"error": f"{type(e).__name__}: {str(e)[:300]}"})
        raise
    worker_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    forked = row["chose"].startswith("pipeline")  # stage plans are made in forked workers
    queue.put({**row, "peak_gb": row["peak_gb"] + forked * usable_cores() * worker_gb})


def in_own_process(job: tuple) -> dict:
    """_row in a fresh (spawned, not daemonic: its planning may fork workers) process; a
    row with "error" where planning failed."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(job, queue))
    proc.start()
    row = queue.get()
    proc.join()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default="inner", choices=("inner", "all", "off"),
                    help="Options.cluster_layers (default inner; off for contrast)")
    ap.add_argument("--skip-70b", action="store_true", help="leave out the Llama-3-70B (4, 8) pipeline-auto row")
    ap.add_argument("--skip-405b", action="store_true", help="leave out the Llama-3.1-405B (8, 8, 8) row")
    ap.add_argument("--skip-dsv3", action="store_true", help="leave out the DeepSeek-V3 (32, 8) row")
    ap.add_argument("--skip-long", action="store_true", help="leave out the Llama-3-8B rows at 131072 tokens")
    args = ap.parse_args()
    print(f"{'shape':<11} {'median s':>9} {'peak GB':>8} {'variables':>10} {'constraints':>11} {'shared':>6} status")
    last: dict[str, tuple[float, float]] = {}
    for name, overrides, label in SHAPES:
        runs = [in_own_process(("flat", name, overrides, args.cluster)) for _ in range(args.repeats)]
        median = statistics.median(r["seconds"] for r in runs)
        r = runs[-1]
        last[label] = (median, max(x["peak_gb"] for x in runs))
        print(f"{label:<11} {median:9.2f} {last[label][1]:8.2f} {r['variables']:10d} {r['constraints']:11d} "
              f"{r['shared']:6d} {r['status']}", flush=True)
    print(f"growth 12->48 layers: {last['GPT-2 48L'][0] / last['GPT-2 12L'][0]:.2f}x (goal <= 4x)")
    big = [("Llama-3-70B (4, 8) pipeline auto", "70b", 15)] * (not args.skip_70b) + \
          [("Llama-3.1-405B (8, 8, 8) pipeline axis 0, bf16, 70 GiB", "405b", 60)] * (not args.skip_405b) + \
          [("DeepSeek-V3 (32, 8), bf16, 70 GiB", "dsv3", 60)] * (not args.skip_dsv3) + \
          [("Llama-3-8B x 131072 (8,), bf16, 70 GiB", ("long", (8,), 1), 60),
           ("Llama-3-8B x 131072 (8, 8), 8 nodes, bf16, 70 GiB", ("long", (8, 8), 8), 60)] * (not args.skip_long)
    for label, kind, goal in big:
        r = in_own_process(kind if isinstance(kind, tuple) else (kind,))
        if "error" in r:
            print(f"{label}: failed: {r['error']}", flush=True)
            continue
        last[label] = (r["seconds"], r["peak_gb"])
        print(f"{label}: {r['seconds']:.1f} s (goal < {goal} s), peak {r['peak_gb']:.2f} GB; chose {r['chose']}, "
              f"predicted step {r['step_ms']:.1f} ms, {r['memory_gib']:.1f} GiB per rank ({r['stage_status']}, "
              + (f"gap up to {r['gap']:.2%})" if r["gap"] is not None else "no gap reported)"), flush=True)
    for label, (seconds, peak) in last.items():
        print(f"{label}: {seconds:.1f} s, peak {peak:.2f} GB")


if __name__ == "__main__":
    main()
