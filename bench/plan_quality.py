"""The solver's plan against the plans experts write by hand, priced by one cost model.

For GPT-2 small and a Llama-shaped model (8 layers, hidden 1024, GQA 16/4 heads) on
meshes (1,8), (2,4) and (8,1), training and inference, prints the predicted step time of
each hand plan (autopar/hand_plans.py: data_parallel, megatron, dp_tp, fsdp - each the
best complete plan of its style) and of autopar's own plan, all on the meta device (no
weights). Last line: 'worst autopar/best-hand ratio: <x>' (goal <= 1.00).

    python bench/plan_quality.py [--device h100] [--batch 8] [--seq 512]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from autopar.passes.plan.hand_plans import STYLES, hand_pins  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.options import Options  # noqa: E402
from autopar.passes.plan.planning import plan_traced, trace_for_planning  # noqa: E402
from autopar.tools.zoo import build  # noqa: E402

MODELS = ("gpt2-small", "llama-small")
MESHES = ((1, 8), (2, 4), (8, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h100", help="cost-model preset (default h100)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    styles = list(STYLES)
    print(f"predicted ms/step on {args.device}, batch {args.batch} x {args.seq} tokens")
    print(f"{'model':<12} {'mode':<6} {'mesh':<7} " + " ".join(f"{s:>13}" for s in styles)
          + f" {'autopar':>9} {'ratio':>6}")
    worst = 0.0
    t0 = time.perf_counter()
    for name in MODELS:
        for training in (True, False):
            model, a, kw = build(name, batch=args.batch, seq=args.seq, training=training, device="meta")
            traced = trace_for_planning(model, a, kw)
            options = Options(device=args.device, training=training)
            for shape in MESHES:
                mesh = Mesh.of(shape)
                hands = {}
                for style in styles:
                    hands[style] = plan_traced(traced, mesh, options, hand_pins(model, traced, shape, style))[1].total_s
                auto = plan_traced(traced, mesh, options)[1].total_s
                ratio = auto / min(hands.values())
                worst = max(worst, ratio)
                print(f"{name:<12} {'train' if training else 'infer':<6} {str(shape):<7} "
                      + " ".join(f"{hands[s] * 1e3:13.3f}" for s in styles)
                      + f" {auto * 1e3:9.3f} {ratio:6.3f}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"worst autopar/best-hand ratio: {worst:.3f}")


if __name__ == "__main__":
    main()
