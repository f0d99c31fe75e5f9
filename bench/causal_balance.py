"""Context parallelism timed (issue #26): causal attention with its rows split along the
sequence, balanced against masked, the same plan on both sides.

A causal language model (embedding, `--layers` blocks of RMSNorm, GQA attention through
sdpa(is_causal=True), SwiGLU MLP, a head) on `--world` gloo ranks, mesh (world,), hand
plan style "cp" (every attention's query rows split along the sequence, keys and values
gathered). Two sides run rank 0's one plan:

  (a) balanced, what autopar runs (autopar/core/causal.py): each rank keeps the first half
      of its rows and computes the second half of its mirror's, each half against the keys
      before its end, the halves swapped by all-to-all;
  (b) masked, what autopar ran before: each rank's rows against every key under an offset
      mask (the rank program built with the balanced module left out).

Timed: training steps (forward, loss, backward, SGD), the slowest rank, the sides taking
turns step by step (bench/_timing.py), one torch thread per rank; medians over --steps.
Both sides' losses must agree at steps 0 and 1 (the same work, the same gradients).

    python bench/causal_balance.py [--world 2] [--seq 4096] [--layers 2] [--steps 6] [--save FILE]

Last line: 'balanced/masked ratio: X' (below 1: the saving).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import warnings
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import launch  # noqa: E402
from _timing import median_steps_s  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

LOSS_RTOL = 1e-5  # fp32: the two forms sum the same products in different blocks

LIMITS = """\
What this can and cannot mean: the ranks share 2 CPU cores with other jobs and gloo sends
over loopback TCP, so the swaps' time here is copies and per-call overhead, not a network's.
The attention's share of the step sets the ceiling: with rows split n ways the masked form
computes rows x L pairs per rank, the balanced one about (2n + 1) / (4n) of that."""


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.gate = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class CausalStack(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _side(base: CausalStack, ids: torch.Tensor, plan, world: int, balanced: bool, lr: float):
    import copy

    import autopar
    import autopar.passes.lower.rewrite as rewrite
    from autopar.core.causal import BalancedCausalRows, causal_rows_attention
    model = copy.deepcopy(base).train()
    keep = rewrite.localize_call

    def masked(*args, **kwargs):  # the local form autopar chose before the balanced one
        target, call_args, call_kwargs = keep(*args, **kwargs)
        if isinstance(target, BalancedCausalRows):
            return causal_rows_attention, (target.chunk, target.ways, target.unit) + tuple(call_args), call_kwargs
        return target, call_args, call_kwargs
    with warnings.catch_warnings(), mock.patch.object(rewrite, "localize_call", keep if balanced else masked):
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, (ids,), mesh=(world,), plan=plan, device="cpu")
        pm(ids)  # the program is emitted at the first call: under the patch for the masked side
    opt = torch.optim.SGD(pm.parameters(), lr=lr)

    def step() -> torch.Tensor:
        loss = pm(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, pm


def _balanced_modules(pm) -> int:
    from autopar.passes.lower.program import CausalRowsModule
    return sum(isinstance(m, CausalRowsModule) for m in pm.current.program.gm.modules())


def run(rank: int, world: int, args) -> None:
    import autopar
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = CausalStack(args.layers, args.hidden, args.heads, args.kv_heads, args.vocab).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    box = [None]
    if rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            box = [autopar.hand_plan(base, (ids,), mesh=(world,), style="cp", device="cpu")]
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    step_a, pm_a = _side(base, ids, plan, world, True, args.lr)
    step_b, pm_b = _side(base, ids, plan, world, False, args.lr)
    counts = (_balanced_modules(pm_a), _balanced_modules(pm_b))
    if counts != (args.layers, 0):
        raise RuntimeError(f"balanced attention modules per side {counts}, expected ({args.layers}, 0)")
    sides = {"a": step_a, "b": step_b}
    losses: dict[str, list[torch.Tensor]] = {s: [] for s in sides}
    for _ in range(2):
        for s, step in sides.items():
            losses[s].append(step())
    timed = median_steps_s(sides, args.steps, args.warmup)
    if rank != 0:
        return
    a, b = timed["a"], timed["b"]
    agree = [torch.allclose(losses["a"][i], losses["b"][i], rtol=LOSS_RTOL, atol=0) for i in (0, 1)]
    attention = [n for n in plan.nodes if n.op == "aten.scaled_dot_product_attention.default"]
    lines = [
        f"causal LM: {args.layers} blocks, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} key/value), "
        f"sdpa is_causal; batch {args.batch} x {args.seq}, fp32, SGD; {world} gloo ranks on mesh ({world},), "
        "one torch thread each; hand plan style cp (attention rows "
        f"{', '.join(sorted({str(n.outputs[0]) for n in attention}))})",
        *(f"step-{i} loss: (a) {losses['a'][i].item():.8f}, (b) {losses['b'][i].item():.8f}: "
          + (f"equal within rtol {LOSS_RTOL:g}" if agree[i] else f"DIFFER beyond rtol {LOSS_RTOL:g}") for i in (0, 1)),
        f"median step, slowest rank, {args.steps} turns after {args.warmup + 2} untimed:",
        f"  (a) balanced (half the rows swapped with the mirror rank): {a * 1e3:8.1f} ms",
        f"  (b) masked (every rank's rows against every key):          {b * 1e3:8.1f} ms",
        f"predicted (cpu preset) for (a): {plan.total_s * 1e3:.1f} ms, of which {plan.comm_s * 1e3:.1f} ms "
        "communication",
        "", LIMITS, "",
        f"balanced/masked ratio: {a / b:.2f}",
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.save:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        header = (f"# python bench/causal_balance.py {' '.join(sys.argv[1:])}".rstrip()
                  + f"  ({world} gloo ranks, 2 shared cores, {datetime.date.today()}, commit {commit or '?'}, "
                  f"torch {torch.__version__})")
        with open(args.save, "a") as f:
            f.write(header + "\n" + text + "\n\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed turns per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed turns per side after steps 0 and 1")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save", default="", help="append the result to this file ('' to not save)")
    args = p.parse_args()
    launch(run, args, args.world, timeout_s=900)


if __name__ == "__main__":
    main()
