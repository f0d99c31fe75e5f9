"""Demo: compile a GPT-2 (random weights from a transformers config) for mesh (2, 4)
and run it on 8 gloo ranks; print the plan and the difference to the single-device
model.

    python examples/demo_gpt2.py                   # spawns 8 CPU ranks itself
    torchrun --nproc-per-node 8 examples/demo_gpt2.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import launch, mesh_size  # noqa: E402


def build_model(layers: int, hidden: int, heads: int, vocab: int, seq: int):
    import transformers
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                     n_positions=seq, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    import autopar
    torch.set_num_threads(1)
    mesh = tuple(int(x) for x in args.mesh.split(","))
    model = build_model(args.layers, args.hidden, args.heads, args.vocab, args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(input_ids=ids, labels=ids)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, mesh=mesh, device=args.device)
        with torch.no_grad():
            out = pm(input_ids=ids, labels=ids)  # traced and planned here, at the first call
    planned_s = time.perf_counter() - t0
    logits_err = (out.logits - reference.logits).abs().max().item()
    loss_err = (out.loss - reference.loss).abs().item()
    errors = torch.tensor([logits_err, loss_err])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"GPT-2: {args.layers} layers, hidden {args.hidden}, {params / 1e6:.2f} M parameters; "
              f"batch {args.batch} x {args.seq} tokens; {world} gloo ranks")
        print(pm.plan.summary())
        print(f"traced + planned + first step in {planned_s:.1f} s")
        print(f"max |logits - single-device logits| over all ranks: {errors[0].item():.3e}")
        print(f"max |loss - single-device loss| over all ranks:     {errors[1].item():.3e}")
        ok = torch.allclose(out.logits, reference.logits, rtol=1.3e-6, atol=1e-5)
        print("MATCH" if ok and errors[0] <= 1e-5 else "MISMATCH")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="2,4", help="mesh shape, e.g. 2,4 (its product is the number of ranks)")
    p.add_argument("--device", default="cpu", help="cost-model preset to plan for: cpu, a100, h100, h200")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    launch(run, args, mesh_size(args.mesh), timeout_s=300)


if __name__ == "__main__":
    main()
