"""autopar's plan against configurations torchtitan publishes, priced by one cost model,
with the predicted tokens/s per GPU beside torchtitan's measured figure.

torchtitan docs/performance.md (H100s with 96 GB HBM2e at 500 W, sequence 8192, bf16):
- Table 1: Llama 3.1 8B on 8 GPUs, FSDP, local batch 2 (global 16), selective
  activation checkpointing, no torch.compile: 5,762 tokens/s/GPU, 82.4 GiB.
- Table 4: Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16 (global 512), full
  activation checkpointing, torch.compile and Float8 (which this cost model does not
  price: the measured figure is a fast reference, not a like-for-like one): 829
  tokens/s/GPU, 71.9 GiB.
Here each shape on the meta device, h100 preset, bf16, training, under an 80 GiB budget:
the hand plan of torchtitan's layout (fsdp; fsdp_tp: Megatron on the 8-way axis, every
parameter's block stored split over the 32-way one; passes/plan/hand_plans.py; the solver
chooses activations and recompute) and autopar's own. Per configuration: the predicted
tokens/s/GPU of both, torchtitan's measured one, and autopar/hand. Table 5's 405B
(FSDP 8 x TP 8 x PP 8) is not here: a hand layout inside pipeline stages is not
expressible yet.

    python bench/published_configs.py [--config 8b|70b|all] [--layers N] [--budget-gib 80]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.options import Options  # noqa: E402
from autopar.passes.plan.hand_plans import hand_pins  # noqa: E402
from autopar.passes.plan.planning import plan_traced, trace_for_planning  # noqa: E402
from autopar.tools.zoo import build  # noqa: E402

SEQ = 8192


@dataclass(frozen=True)
class Published:
    name: str
    overrides: dict  # on the llama3-8b zoo shape
    batch: int  # global batch, sequences
    mesh: tuple[int, ...]
    nodes: int
    style: str  # the hand layout of torchtitan's configuration
    measured_tps: int  # tokens/s/GPU, torchtitan's table
    what: str


CONFIGS = {
    "8b": Published("Llama 3.1 8B, FSDP on 8", {}, 16, (8,), 1, "fsdp", 5762,
                    "FSDP, 8 x H100, bf16, selective AC (Table 1)"),
    "70b": Published("Llama 3.1 70B, FSDP 32 x TP 8 on 256",
                     dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8), 512, (32, 8), 32, "fsdp_tp", 829,
                     "FSDP 32 x TP 8, 256 x H100, full AC, torch.compile + Float8 (Table 4)"),
}


def compare(config: Published, layers: "int | None", budget_gib: float) -> float:
    """Prints the two plans and the figures; returns autopar/hand."""
    t0 = time.perf_counter()
    overrides = {**config.overrides, **({"num_hidden_layers": layers} if layers else {})}
    model, a, kw = build("llama3-8b", batch=config.batch, seq=SEQ, training=True, device="meta", **overrides)
    traced = trace_for_planning(model, a, kw, torch.bfloat16)
    options = Options(device="h100", training=True, param_dtype=torch.bfloat16, nodes=config.nodes,
                      memory_budget_bytes=int(budget_gib * 2**30))
    mesh = Mesh.of(config.mesh)
    print(f"== {config.name} (mesh {config.mesh}, {config.nodes} nodes, batch {config.batch} x {SEQ})", flush=True)
    rows = {}
    for label, pins in ((f"{config.style} (torchtitan's)", hand_pins(model, traced, config.mesh, config.style)),
                        ("autopar", None)):
        start = time.perf_counter()
        plan = plan_traced(traced, mesh, options, pins)[1]
        tps = config.batch * SEQ / plan.total_s / mesh.size
        rows[label] = plan
        print(f"{label:<22} step {plan.total_s * 1e3:9.1f} ms  {tps:8.0f} tokens/s/GPU predicted  "
              f"memory {plan.memory_bytes / 2**30:5.1f} GiB  recomputed blocks {len(plan.recompute):2d}  "
              f"({time.perf_counter() - start:.0f} s to plan)", flush=True)
    hand, auto = rows[f"{config.style} (torchtitan's)"], rows["autopar"]
    print(f"torchtitan measured: {config.measured_tps} tokens/s/GPU ({config.what})")
    print(f"predicted {config.style} / measured: "
          f"{config.batch * SEQ / hand.total_s / mesh.size / config.measured_tps:.2f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    ratio = auto.total_s / hand.total_s
    print(f"autopar/hand ratio: {ratio:.3f}", flush=True)
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="all", choices=(*CONFIGS, "all"))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick look (default: the model's)")
    ap.add_argument("--budget-gib", type=float, default=80.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    chosen = list(CONFIGS) if args.config == "all" else [args.config]
    ratios = {name: compare(CONFIGS[name], args.layers, args.budget_gib) for name in chosen}
    print("autopar/hand: " + ", ".join(f"{name} {r:.3f}" for name, r in ratios.items()))


if __name__ == "__main__":
    main()
