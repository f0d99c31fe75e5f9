"""Where a plan on a mesh of three axes under a memory budget spends its time: the
Llama-3-8B shape (training, batch 8 x 1024, bf16 compute, h100 preset, on the meta device)
planned on (2, 2, 2) with a 70 GiB budget, so that memory is priced (parameters stored
sharded and gathered where used, blocks recomputed). Prints the seconds of the whole plan,
of each dominance pruning (passes/solve/dominance.py; the first is the warm start's merged
two-axis mesh), the ILP's columns and rows, the solver's status and the plan's digest.

    python bench/three_axis_budget.py [--layers 32] [--mesh 2,2,2] [--time-limit-s 120] [--budget-gib 70]

--budget-gib 0 plans without a budget: the solve then goes by column generation
(passes/solve/column_generation.py), and the line also prints the proven bound.

This is the shape of the plain candidate of pipeline_axis="auto" on a three-axis mesh
(the Llama-3.1-405B shape on (8, 8, 8) is the same problem, larger), and of mesh="auto"'s
three-axis candidates under a budget.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import autopar  # noqa: E402
import autopar.passes.solve.solve as solve_module  # noqa: E402
from autopar.tools.zoo import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--mesh", default="2,2,2")
    ap.add_argument("--time-limit-s", type=float, default=120.0)
    ap.add_argument("--budget-gib", type=float, default=70.0, help="0: no budget")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    mesh = tuple(int(x) for x in args.mesh.split(","))
    pruning_s: list[float] = []
    prune = solve_module.prune_dominated

    def timed_prune(*a, **k):
        t = time.perf_counter()
        try:
            return prune(*a, **k)
        finally:
            pruning_s.append(time.perf_counter() - t)
    solve_module.prune_dominated = timed_prune
    model, inputs, kwargs = build("llama3-8b", device="meta", batch=8, seq=1024, training=True,
                                  num_hidden_layers=args.layers)
    t0 = time.perf_counter()
    plan = autopar.plan(model, inputs, kwargs, mesh=mesh, device="h100", param_dtype=torch.bfloat16,
                        memory_budget_bytes=int(args.budget_gib * 2**30) or None, time_limit_s=args.time_limit_s)
    seconds = time.perf_counter() - t0
    s = plan.solver
    bound = f", bound {s.bound_s * 1e3:.3f} ms" if s.bound_s is not None else ""
    budget = f"{args.budget_gib:g} GiB" if args.budget_gib else "no budget"
    print(f"Llama-3-8B shape, {args.layers} layers, on {mesh}, bf16, {budget}: {seconds:.1f} s; pruning "
          f"{', '.join(f'{p:.1f}' for p in pruning_s)} s; ILP {s.variables:,} columns, {s.constraints:,} rows, "
          f"solve {s.solve_time_s:.1f} s, {s.status}; step {plan.total_s * 1e3:.3f} ms{bound}, digest {plan.digest()}")


if __name__ == "__main__":
    main()
