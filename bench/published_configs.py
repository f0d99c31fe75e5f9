"""autopar's plan against configurations torchtitan publishes, priced by one cost model,
with the predicted tokens/s per GPU beside torchtitan's measured figure.

torchtitan docs/performance.md (H100s with 96 GB HBM2e at 500 W, sequence 8192, bf16):
- Table 1: Llama 3.1 8B on 8 GPUs, FSDP, local batch 2 (global 16), selective
  activation checkpointing, no torch.compile: 5,762 tokens/s/GPU, 82.4 GiB.
- Table 4: Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16 (global 512), full
  activation checkpointing, torch.compile and Float8 (which this cost model does not
  price: the measured figure is a fast reference, not a like-for-like one): 829
  tokens/s/GPU, 71.9 GiB.
- Table 5: Llama 3.1 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, interleaved 1F1B, local
  batch 32 (global 256), full activation checkpointing, torch.compile, Float8 and
  AsyncTP (not priced either): 128 tokens/s/GPU, 72.7 GiB.
Here each shape on the meta device, h100 preset, bf16, training, under an 80 GiB budget:
the hand plan of torchtitan's layout (fsdp; fsdp_tp: Megatron on the 8-way axis, every
parameter's block stored split over the 32-way one; passes/plan/hand_plans.py; the solver
chooses activations and recompute) and autopar's own. The 405B one pipelines mesh axis 0
(32 microbatches of 8 sequences, one per FSDP rank, as torchtitan's microbatch of 1):
fsdp_tp holds inside every stage on the (8, 8) sub-mesh, and both plans take the stage
split autopar's prices choose, so they differ in the stages' layouts only. Per
configuration: the predicted tokens/s/GPU of both, torchtitan's measured one, and
autopar/hand.

    python bench/published_configs.py [--config 8b|70b|405b|all] [--layers N] [--budget-gib 80]
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
from autopar.passes.plan.hand_plans import hand_pins, hand_plan  # noqa: E402
from autopar.api import plan as autopar_plan  # noqa: E402
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
    pipeline_axis: "int | None" = None
    microbatches: int = 1
    schedule: str = "1f1b"


CONFIGS = {
    "8b": Published("Llama 3.1 8B, FSDP on 8", {}, 16, (8,), 1, "fsdp", 5762,
                    "FSDP, 8 x H100, bf16, selective AC (Table 1)"),
    "70b": Published("Llama 3.1 70B, FSDP 32 x TP 8 on 256",
                     dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8), 512, (32, 8), 32, "fsdp_tp", 829,
                     "FSDP 32 x TP 8, 256 x H100, full AC, torch.compile + Float8 (Table 4)"),
    "405b": Published("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 on 512",
                      dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                           num_key_value_heads=8), 256, (8, 8, 8), 64, "fsdp_tp", 128,
                      "FSDP 8 x TP 8 x PP 8, 512 x H100, interleaved 1F1B, full AC, torch.compile + Float8 + "
                      "AsyncTP (Table 5)", pipeline_axis=0, microbatches=32, schedule="interleaved_1f1b"),
}


def compare(config: Published, layers: "int | None", budget_gib: float) -> float:
    """Prints the two plans and the figures; returns autopar/hand."""
    t0 = time.perf_counter()
    overrides = {**config.overrides, **({"num_hidden_layers": layers} if layers else {})}
    model, a, kw = build("llama3-8b", batch=config.batch, seq=SEQ, training=True, device="meta", **overrides)
    options = Options(device="h100", training=True, param_dtype=torch.bfloat16, nodes=config.nodes,
                      memory_budget_bytes=int(budget_gib * 2**30), pipeline_axis=config.pipeline_axis,
                      microbatches=config.microbatches, pipeline_schedule=config.schedule)
    mesh = Mesh.of(config.mesh)
    print(f"== {config.name} (mesh {config.mesh}, {config.nodes} nodes, batch {config.batch} x {SEQ})", flush=True)
    rows = {}
    for label, planned in _sides(model, a, kw, config, options):
        start = time.perf_counter()
        plan = planned()
        tps = config.batch * SEQ / plan.total_s / mesh.size
        rows[label] = plan
        print(f"{label:<22} step {plan.total_s * 1e3:9.1f} ms  {tps:8.0f} tokens/s/GPU predicted  "
              f"memory {plan.memory_bytes / 2**30:5.1f} GiB  recomputed blocks {_recomputed(plan):2d}  "
              f"({time.perf_counter() - start:.0f} s to plan; {_solved(plan)})", flush=True)
    hand, auto = rows[f"{config.style} (torchtitan's)"], rows["autopar"]
    print(f"torchtitan measured: {config.measured_tps} tokens/s/GPU ({config.what})")
    print(f"predicted {config.style} / measured: "
          f"{config.batch * SEQ / hand.total_s / mesh.size / config.measured_tps:.2f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    ratio = auto.total_s / hand.total_s
    print(f"autopar/hand ratio: {ratio:.3f}", flush=True)
    return ratio


def _sides(model: torch.nn.Module, a: tuple, kw: dict, config: Published, options: Options) -> tuple:
    """(label, a function making that plan) for the hand plan and autopar's: one trace
    shared where nothing pipelines; a pipelined plan traces its microbatch and stages."""
    hand = f"{config.style} (torchtitan's)"
    if config.pipeline_axis is not None:
        return ((hand, lambda: hand_plan(model, a, kw, mesh=config.mesh, style=config.style, options=options)),
                ("autopar", lambda: autopar_plan(model, a, kw, mesh=config.mesh, options=options)))
    traced = trace_for_planning(model, a, kw, torch.bfloat16)
    mesh = Mesh.of(config.mesh)
    return ((hand, lambda: plan_traced(traced, mesh, options, hand_pins(model, traced, config.mesh, config.style))[1]),
            ("autopar", lambda: plan_traced(traced, mesh, options)[1]))


def _solved(plan) -> str:
    """The solver's status and gap, of each stage's solve where the plan pipelines (a time
    limit leaves the best plan found, which may recompute more than the budget needs)."""
    reports = [sp.solver for sp in plan.stage_plans] or [plan.solver]
    gaps = [r.gap for r in reports if r.gap is not None]
    statuses = sorted({r.status for r in reports})
    return f"{', '.join(statuses)}" + (f", gap up to {max(gaps) * 100:.2f} %" if gaps else "")


def _recomputed(plan) -> int:
    """Blocks recomputed: the plan's own, or its stages' where it pipelines."""
    return len(plan.recompute) + sum(len(sp.recompute) for sp in plan.stage_plans or ())


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
