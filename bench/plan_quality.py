"""The solver's plan against the plans experts write by hand, priced by one cost model.

For GPT-2 small and a Llama-shaped model (8 layers, hidden 1024, GQA 16/4 heads) on
meshes (1,8), (2,4) and (8,1), training and inference, prints the predicted step time of
each hand plan (passes/plan/hand_plans.py: data_parallel, megatron, dp_tp, fsdp and the
context-parallel cp, dp_cp, fsdp_cp, tp_cp - each the best complete plan of its style)
and of autopar's own plan, all on the meta device (no weights). Then the long-sequence
shape: Llama-3-8B's layer (hidden 4096, 32/8 heads) stacked --long-layers deep, one
sequence of --long-seq tokens, bf16, training under a 20 GiB budget on (8,) and (2,4),
returning its loss and logits as transformers does ("long"), the same with the logits left
in the layout the plan makes them (Options.sharded_outputs: a DTensor; "split"), and
returning the loss alone (what a training loop reads; "loss"); under each, the share of
autopar's step that is exposed (unhidden) communication.
A style no plan of which fits the budget, or that does not apply to the mesh (dp_cp on
(8,1): its sequence axis has size 1), prints "-". Last line: 'worst autopar/best-hand
ratio: <x>' (goal <= 1.00).

    python bench/plan_quality.py [--device h100] [--batch 8] [--seq 512] [--long-seq 32768] [--long-layers 2]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import replace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from autopar.passes.plan.hand_plans import STYLES, hand_pins  # noqa: E402
from autopar.core.errors import HandPlanError, MemoryBudgetError  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.options import Options  # noqa: E402
from autopar.passes.plan.planning import plan_traced, trace_for_planning  # noqa: E402
from autopar.tools.zoo import LossOnly, build  # noqa: E402

MODELS = ("gpt2-small", "llama-small")
MESHES = ((1, 8), (2, 4), (8, 1))
LONG_MESHES = ((8,), (2, 4))
LONG_BUDGET = 20 * 2**30


def row(label: str, traced, model, shape: tuple[int, ...], options: Options, styles: list[str]) -> tuple[float, Any]:
    """Print one row (each style's and autopar's predicted ms); returns autopar/best-hand
    and autopar's plan."""
    mesh = Mesh.of(shape)
    hands: dict[str, float] = {}
    for style in styles:
        try:
            hands[style] = plan_traced(traced, mesh, options, hand_pins(model, traced, shape, style))[1].total_s
        except (MemoryBudgetError, HandPlanError):  # no plan of the style fits, or the style does not apply
            pass
    plan = plan_traced(traced, mesh, options)[1]
    auto = plan.total_s
    ratio = auto / min(hands.values())
    print(f"{label} {str(shape):<7} " + " ".join(f"{hands[s] * 1e3:9.3f}" if s in hands else f"{'-':>9}"
                                             for s in styles) + f" {auto * 1e3:9.3f} {ratio:6.3f}", flush=True)
    return ratio, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h100", help="cost-model preset (default h100)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--long-seq", type=int, default=32768)
    ap.add_argument("--long-layers", type=int, default=2)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    styles = list(STYLES)
    header = " ".join(f"{s[:9]:>9}" for s in styles) + f" {'autopar':>9} {'ratio':>6}"
    print(f"predicted ms/step on {args.device}, batch {args.batch} x {args.seq} tokens")
    print(f"{'model':<12} {'mode':<6} {'mesh':<7} " + header)
    worst = 0.0
    t0 = time.perf_counter()
    for name in MODELS:
        for training in (True, False):
            model, a, kw = build(name, batch=args.batch, seq=args.seq, training=training, device="meta")
            traced = trace_for_planning(model, a, kw)
            options = Options(device=args.device, training=training)
            for shape in MESHES:
                label = f"{name:<12} {'train' if training else 'infer':<6}"
                worst = max(worst, row(label, traced, model, shape, options, styles)[0])
    print(f"\nLlama-3-8B layers x{args.long_layers}, 1 x {args.long_seq} tokens, bf16, training, "
          f"budget {LONG_BUDGET / 2**30:.0f} GiB")
    lm, a, kw = build("llama3-8b", batch=1, seq=args.long_seq, training=True, device="meta",
                      num_hidden_layers=args.long_layers)
    options = Options(device=args.device, training=True, param_dtype=torch.bfloat16, memory_budget_bytes=LONG_BUDGET)
    traced = trace_for_planning(lm, a, kw, torch.bfloat16)
    loss_only = LossOnly(lm)
    sides = (("long", lm, traced, options), ("split", lm, traced, replace(options, sharded_outputs=True)),
             ("loss", loss_only, trace_for_planning(loss_only, a, kw, torch.bfloat16), options))
    for label, model, traced, opts in sides:
        for shape in LONG_MESHES:
            ratio, plan = row(f"{'llama3-8b':<12} {label:<6}", traced, model, shape, opts, styles)
            worst = max(worst, ratio)
            exposed = (plan.comm_s - plan.hidden_s) / plan.total_s
            print(f"{'':<12} {'':<6} {'':<7} autopar: step {plan.total_s * 1e3:.1f} ms, exposed communication "
                  f"{(plan.comm_s - plan.hidden_s) * 1e3:.1f} ms ({exposed:.0%} of the step)", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"worst autopar/best-hand ratio: {worst:.3f}")


if __name__ == "__main__":
    main()
