"""Train a small GPT-2 on 8 gloo ranks (mesh (2, 4)) and print its loss falling beside
the single-device model's loss at the same steps.

    python examples/train_gpt2.py --steps 200          # spawns 8 CPU ranks itself
    torchrun --nproc-per-node 8 examples/train_gpt2.py

The data is a synthetic language (noisy repetitions of random phrases), so there is
something to learn without downloads. Dropout is off: with dropout each rank would
draw its own mask (per-rank RNG), which is valid training but not comparable step by
step with one device.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _launch import launch, mesh_size  # noqa: E402


def corpus(vocab: int, seq: int, batch: int, steps: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phrases = torch.randint(1, vocab, (16, 8), generator=g)
    picks = torch.randint(0, 16, (steps, batch, seq // 8), generator=g)
    data = phrases[picks].reshape(steps, batch, seq)
    noise = torch.rand(data.shape, generator=g) < 0.05
    return torch.where(noise, torch.randint(1, vocab, data.shape, generator=g), data)


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    import transformers
    import autopar
    torch.set_num_threads(1)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                     vocab_size=args.vocab, n_positions=args.seq, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model) if rank == 0 else None
    data = corpus(args.vocab, args.seq, args.batch, args.steps)
    mesh = tuple(int(x) for x in args.mesh.split(","))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, mesh=mesh, device=args.device)  # planned at the first call
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None
    t0 = time.perf_counter()
    for step in range(args.steps):
        ids = data[step]
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if reference is not None:
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            if step == 0:
                print(pm.plan.summary(), flush=True)
                print(f"{'step':>6} {'loss (8 ranks)':>15} {'loss (1 device)':>16}", flush=True)
            if step % args.every == 0 or step == args.steps - 1:
                print(f"{step:>6} {loss.item():>15.4f} {ref_loss.item():>16.4f}", flush=True)
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s (including the single-device reference)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="2,4")
    p.add_argument("--device", default="cpu", help="cost-model preset to plan for")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    launch(run, args, mesh_size(args.mesh), timeout_s=600)


if __name__ == "__main__":
    main()
