"""Activation recompute chosen by the ILP: saved-activation bytes predicted by the plan
against those measured in one training forward, with and without recompute.

A 4-layer Llama (or GPT-2) planned for training on a mesh, once without a budget (every
activation kept) and once at the smallest footprint (MemoryBudgetError's figure: every
block recomputed where that helps). Each plan's rank programs run in the in-process
simulator (passes/lower/simulate_mesh.py) and autopar/tools/memory_meter.py sums the bytes the
forward leaves allocated for backward, per rank. Last line: 'measured/predicted
activation bytes: X' for the recomputing plan.

    python bench/recompute_memory.py [--model llama|gpt2] [--mesh 1] [--batch 4] [--seq 32]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from autopar.core.errors import MemoryBudgetError  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.options import Options  # noqa: E402
from autopar.passes.plan.planning import plan_traced  # noqa: E402
from autopar.passes.trace.trace import trace  # noqa: E402
from autopar.tools.memory_meter import kept_per_rank  # noqa: E402


def _model(name: str, layers: int):
    import transformers as T
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=128, attn_pdrop=0.0,
                           resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(cfg).train()
    cfg = T.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, use_cache=False)
    return T.LlamaForCausalLM(cfg).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=("llama", "gpt2"))
    ap.add_argument("--mesh", default="1", help="comma-separated axis sizes (default 1)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    mesh = Mesh(tuple(int(x) for x in a.mesh.split(",")))
    model = _model(a.model, a.layers)
    ids = torch.randint(1, 128, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    args, kwargs = (), {"input_ids": ids, "labels": ids}
    traced = trace(model, args, kwargs)
    options = Options(training=True)
    free = plan_traced(traced, mesh, options)[1]
    try:
        plan_traced(traced, mesh, Options(training=True, memory_budget_bytes=1))
        raise SystemExit("a 1-byte budget was met?")
    except MemoryBudgetError as e:
        smallest = e.smallest_bytes
    t0 = time.perf_counter()
    tight = plan_traced(traced, mesh, Options(training=True, memory_budget_bytes=smallest))[1]
    print(f"{a.model}, {a.layers} layers, batch {a.batch} x {a.seq}, mesh {mesh.shape}, training; "
          f"budget {smallest} B (the smallest footprint), solved in {time.perf_counter() - t0:.2f} s")
    print(f"recomputed: {', '.join(b.name for b in tight.recompute) or 'none'}")
    print(f"{'plan':<12} {'predicted B':>12} {'measured B':>12} {'ratio':>6} {'step ms':>9}")
    measured = {}
    for label, plan in (("keep all", free), ("recompute", tight)):
        measured[label] = kept_per_rank(model, args, kwargs, traced, plan)
        print(f"{label:<12} {plan.activation_bytes:>12} {measured[label]:>12.0f} "
              f"{measured[label] / plan.activation_bytes:>6.3f} {plan.total_s * 1e3:>9.3f}")
    drop_p = free.activation_bytes - tight.activation_bytes
    drop_m = measured["keep all"] - measured["recompute"]
    print(f"drop: predicted {drop_p} B, measured {drop_m:.0f} B, measured/predicted {drop_m / drop_p:.3f}")
    print(f"measured/predicted activation bytes: {measured['recompute'] / tight.activation_bytes:.3f}")


if __name__ == "__main__":
    main()
