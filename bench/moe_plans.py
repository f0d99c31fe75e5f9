"""Expert parallelism priced: a Qwen3-MoE-shaped model planned offline on the meta device.

Shape (issue #26): 4 layers, hidden 2048, 32/4 heads, 64 experts, top-8, expert width
768, batch 8 x 2048 tokens, training, h100 preset, mesh (8,), fp32, under --budget GiB
per rank. Prints the predicted step of the fsdp and ep hand plans (passes/plan/hand_plans.py)
and of autopar's own plan, how each lays out its routed experts (experts/ids per MoE
layer: S(0)/S(0) is expert parallelism, R/S(0) experts gathered with rows split), and
the ratio autopar/best hand plan. Every side returns the logits split over the ranks
(Options.sharded_outputs): whole on every rank they are 9.3 GiB (8 x 2048 x 151936 fp32
values), which plans count since 2370506, and no plan fits 12 GiB with them.

    python bench/moe_plans.py [--budget 12] [--mesh 8]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from autopar.core.errors import MemoryBudgetError  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.options import Options  # noqa: E402
from autopar.passes.plan.hand_plans import hand_pins  # noqa: E402
from autopar.passes.plan.planning import plan_traced, trace_for_planning  # noqa: E402


def qwen3_moe_shape() -> tuple[torch.nn.Module, dict]:
    config = transformers.Qwen3MoeConfig(num_hidden_layers=4, hidden_size=2048, num_attention_heads=32,
                                         num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                                         num_experts=64, num_experts_per_tok=8, vocab_size=151936,
                                         intermediate_size=6144, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config).train()
    ids = torch.randint(0, 1000, (8, 2048), device="meta")
    return model, {"input_ids": ids, "labels": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=12.0, help="GiB per rank (0: none)")
    ap.add_argument("--mesh", default="8", help="mesh shape, e.g. 8 or 2,4")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    shape = tuple(int(x) for x in args.mesh.split(","))
    model, kwargs = qwen3_moe_shape()
    t0 = time.perf_counter()
    traced = trace_for_planning(model, (), kwargs)
    print(f"traced in {time.perf_counter() - t0:.1f} s")
    options = Options(device="h100", training=True, sharded_outputs=True,
                      memory_budget_bytes=int(args.budget * 2**30) if args.budget else None)
    hands = {}
    for style in ("fsdp", "ep", None):
        t0 = time.perf_counter()
        try:
            plan = plan_traced(traced, Mesh.of(shape), options, hand_pins(model, traced, shape, style) if style else None)[1]
        except MemoryBudgetError as e:
            print(f"{style}: does not fit ({str(e)[:120]})")
            continue
        routed = sorted({f"{n.inputs[-1]}/{n.inputs[0]}" for n in plan.nodes if n.op == "autopar.routed_experts.default"})
        print(f"{style or 'autopar':<8} step {plan.total_s * 1e3:7.1f} ms: compute {plan.compute_s * 1e3:6.1f}, "
              f"communication {plan.comm_s * 1e3:6.1f} ms, memory {plan.memory_bytes / 2**30:5.2f} GiB/rank; "
              f"experts/ids {', '.join(routed)} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if style:
            hands[style] = plan.total_s
        else:
            print(f"autopar/best hand ratio: {plan.total_s / min(hands.values()):.3f}")


if __name__ == "__main__":
    main()
