"""autopar against the peers a user would otherwise pick, 8 gloo ranks, same model and data:

  - torch's hand-written tensor parallelism (parallelize_module with the Megatron plan:
    column-parallel q/k/v/gate/up, row-parallel o/down) on mesh (1, 8), small batch;
  - DistributedDataParallel on mesh (8, 1), large batch.

    python bench/peer_speed.py [--steps 10]

Prints the median training-step time (slowest rank) of each and their ratio; last line
'worst autopar/peer step-time ratio: <x>'."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _timing import median_step_s  # noqa: E402
from torch import nn  # noqa: E402
from _launch import launch  # noqa: E402


class Block(nn.Module):
    """A Llama-shaped block whose head count follows its weights' local size, so torch's
    tensor parallelism can shard it without rewriting the module."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        a = nn.functional.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)),
                                                       is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, layers=2, hidden=512, heads=8, ffn=1536) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return (x.float() ** 2).mean()


def _trainer(module, opt, x):
    def step():
        loss = module(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def run(rank: int, world: int, args) -> None:
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Model()
    results = []
    # 1. tensor parallel, small batch, mesh (1, 8)
    x_small = torch.randn(1, 64, 512, generator=torch.Generator().manual_seed(1))
    tp = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(len(tp.blocks)):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "gate", "up")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "down")})
    parallelize_module(tp, mesh, plan)
    peer = median_step_s(_trainer(tp, torch.optim.AdamW(tp.parameters(), lr=1e-4), x_small), args.steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(copy.deepcopy(base).train(), (x_small,), mesh=(1, world))
    ours = median_step_s(_trainer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), x_small), args.steps)
    results.append(("parallelize_module Megatron, (1,8), batch 1x64", peer, ours, pm.plan))
    # 2. data parallel, large batch, mesh (8, 1)
    x_large = torch.randn(64, 64, 512, generator=torch.Generator().manual_seed(2))
    shard = x_large.chunk(world)[rank]
    ddp = DistributedDataParallel(copy.deepcopy(base))
    peer = median_step_s(_trainer(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), shard), args.steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(copy.deepcopy(base).train(), (x_large,), mesh=(world, 1))
    ours = median_step_s(_trainer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), x_large), args.steps)
    results.append(("DistributedDataParallel, (8,1), batch 64x64", peer, ours, pm.plan))
    if rank == 0:
        for name, peer, ours, plan in results:
            print(f"{name}: peer {peer * 1e3:.1f} ms, autopar {ours * 1e3:.1f} ms, ratio {ours / peer:.2f}")
            print("  autopar plan: " + plan.summary().splitlines()[2].strip())
        print(f"worst autopar/peer step-time ratio: {max(o / p for _, p, o, _ in results):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    launch(run, p.parse_args(), 8, timeout_s=900)


if __name__ == "__main__":
    main()
