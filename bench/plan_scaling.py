"""Planning time as models deepen: the GPT-2 small shape at 12, 24 and 48 layers on mesh
(2,4), and the Llama-3-8B shape (32 layers, hidden 4096, 32/8 heads, vocab 128256), all
on the meta device (no weights), training, h100 preset. Planning time is autopar.plan
end to end: trace, strategies, ILP build and solve, plan read-back.

    python bench/plan_scaling.py [--repeats 3] [--cluster inner|all|off]

Prints the median of --repeats runs per shape with the ILP's size; last line
'growth 12->48 layers: <x>x' (goals: <= 4x; the 8B shape under 30 s). Then, once (it is
the slowest), the Llama-3-70B shape (80 layers, hidden 8192, 64/8 heads) on mesh (4, 8)
over 4 nodes with pipeline_axis="auto" and 8 microbatches: the planner prices stages on
each axis's sub-mesh against the plain plan (goal: under 60 s); --skip-70b leaves it out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import autopar  # noqa: E402
from autopar.tools.zoo import build  # noqa: E402

SHAPES = (("gpt2-small", {"n_layer": 12}, "GPT-2 12L"), ("gpt2-small", {"n_layer": 24}, "GPT-2 24L"),
          ("gpt2-small", {"n_layer": 48}, "GPT-2 48L"), ("llama3-8b", {}, "Llama-3-8B"))


def plan_once(name: str, overrides: dict, cluster: str):
    model, args, kwargs = build(name, batch=8, seq=512, training=True, device="meta", **overrides)
    t = time.perf_counter()
    plan = autopar.plan(model, args, kwargs, mesh=(2, 4), device="h100", cluster_layers=cluster)
    return time.perf_counter() - t, plan


LLAMA3_70B = dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                  num_key_value_heads=8)


def plan_70b():
    """The Llama-3-70B shape on (4, 8), 4 nodes, pipeline 'auto' (meta device: no weights)."""
    model, args, kwargs = build("llama3-8b", batch=8, seq=512, training=True, device="meta", **LLAMA3_70B)
    t = time.perf_counter()
    plan = autopar.plan(model, args, kwargs, mesh=(4, 8), device="h100", nodes=4, pipeline_axis="auto",
                        microbatches=8)
    return time.perf_counter() - t, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default="inner", choices=("inner", "all", "off"),
                    help="Options.cluster_layers (default inner; off for contrast)")
    ap.add_argument("--skip-70b", action="store_true", help="leave out the Llama-3-70B (4, 8) pipeline-auto row")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"{'shape':<11} {'median s':>9} {'ILP s':>7} {'variables':>10} {'constraints':>11} {'shared':>6} status")
    medians = {}
    for name, overrides, label in SHAPES:
        runs = [plan_once(name, overrides, args.cluster) for _ in range(args.repeats)]
        median = statistics.median(t for t, _ in runs)
        s = runs[-1][1].solver
        medians[label] = median
        print(f"{label:<11} {median:9.2f} {s.solve_time_s:7.2f} {s.variables:10d} {s.constraints:11d} "
              f"{s.shared_blocks:6d} {s.status}", flush=True)
    if not args.skip_70b:
        seconds, plan = plan_70b()
        p = plan.pipeline
        chose = (f"pipeline axis {p.axis}, {len(p.stages)} stages" if p is not None else "no pipeline")
        print(f"Llama-3-70B shape (4, 8) pipeline auto: {seconds:.1f} s (goal < 60 s); chose {chose}, "
              f"predicted step {plan.total_s * 1e3:.1f} ms", flush=True)
    print(f"Llama-3-8B shape: {medians['Llama-3-8B']:.1f} s (goal < 30 s)")
    print(f"growth 12->48 layers: {medians['GPT-2 48L'] / medians['GPT-2 12L']:.2f}x")


if __name__ == "__main__":
    main()
