"""autopar's plan against a configuration torchtitan publishes, priced by one cost model,
with the predicted tokens/s per GPU beside torchtitan's measured figure.

torchtitan docs/performance.md, Table 1: Llama 3.1 8B on 8 H100 (96 GB HBM2e, 500 W),
FSDP, local batch 2 (global 16), sequence 8192 (its llama3 8B default), bf16, selective
activation checkpointing, no torch.compile: 5,762 tokens/s/GPU, 82.4 GiB. Here the same
shape on the meta device, mesh (8,), h100 preset, bf16, training, under an 80 GiB budget:
the fsdp hand plan (every parameter stored split and gathered where used, batch split;
the solver chooses activations and recompute) and autopar's own. Last lines: the
predicted tokens/s/GPU of both, torchtitan's measured one, and autopar/hand.

    python bench/published_configs.py [--layers 32] [--budget-gib 80]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.options import Options  # noqa: E402
from autopar.passes.plan.hand_plans import hand_pins  # noqa: E402
from autopar.passes.plan.planning import plan_traced, trace_for_planning  # noqa: E402
from autopar.tools.zoo import build  # noqa: E402

BATCH, SEQ, MESH = 16, 8192, (8,)
TORCHTITAN_TPS = 5762  # tokens/s/GPU, FSDP, 8 x H100, Table 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="Llama-3-8B's 32 (fewer for a quick look)")
    ap.add_argument("--budget-gib", type=float, default=80.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    model, a, kw = build("llama3-8b", batch=BATCH, seq=SEQ, training=True, device="meta",
                         num_hidden_layers=args.layers)
    traced = trace_for_planning(model, a, kw, torch.bfloat16)
    options = Options(device="h100", training=True, param_dtype=torch.bfloat16,
                      memory_budget_bytes=int(args.budget_gib * 2**30))
    mesh = Mesh.of(MESH)
    rows = {}
    for label, pins in (("fsdp (torchtitan's)", hand_pins(model, traced, MESH, "fsdp")), ("autopar", None)):
        start = time.perf_counter()
        plan = plan_traced(traced, mesh, options, pins)[1]
        tps = BATCH * SEQ / plan.total_s / mesh.size
        rows[label] = plan
        print(f"{label:<20} step {plan.total_s * 1e3:9.1f} ms  {tps:8.0f} tokens/s/GPU predicted  "
              f"memory {plan.memory_bytes / 2**30:5.1f} GiB  recomputed blocks {len(plan.recompute):2d}  "
              f"({time.perf_counter() - start:.0f} s to plan)", flush=True)
    hand, auto = rows["fsdp (torchtitan's)"], rows["autopar"]
    print(f"torchtitan measured: {TORCHTITAN_TPS} tokens/s/GPU (FSDP, 8 x H100, bf16, selective AC)")
    print(f"predicted fsdp / measured: {BATCH * SEQ / hand.total_s / mesh.size / TORCHTITAN_TPS:.2f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"autopar/hand ratio: {auto.total_s / hand.total_s:.3f}")


if __name__ == "__main__":
    main()
