"""autopar against the programs a user would otherwise write, 8 gloo ranks, same model,
data, optimiser (AdamW), mesh and batch on both sides, one torch thread per rank:

  - DistributedDataParallel on mesh (8, 1), large batch;
  - FSDP2 (fully_shard per block and at the root) on mesh (8, 1), the same batch;
  - torch's tensor parallelism (parallelize_module, Megatron plan: column-parallel
    q/k/v/gate/up, row-parallel o/down) on mesh (1, 8), small batch;
  - 2-D: FSDP2 over mesh axis 0 and the Megatron plan over axis 1, mesh (2, 4).

    python bench/peer_speed.py [--steps 10] [--compile]

Each row times the peer, autopar with its collectives overlapped (the default), and
autopar with Options(overlap=False) (every collective blocking where the rewrite put
it: what autopar ran before), taking turns step by step (bench/_timing.py), so the
machine's load falls on every side alike. --compile adds each row again with every side
under torch.compile: the peer module through torch.compile, autopar with
Options(compile=True) (slow here: every rank compiles). Prints median step times (slowest rank) and ratios; last line
'worst autopar/peer ratio: <x>'."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _timing import median_steps_s  # noqa: E402
from _launch import launch  # noqa: E402
from _blocks import Model  # noqa: E402


def _trainer(module, opt, x):
    def step():
        loss = module(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _autopar(base, x, mesh, **options):
    import autopar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(copy.deepcopy(base).train(), (x,), mesh=mesh, **options)


def _peers(base, world, rank):
    """name -> (build the peer module, its input, autopar's mesh, autopar's input)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel
    x_large = torch.randn(64, 64, 512, generator=torch.Generator().manual_seed(2))
    x_small = torch.randn(1, 64, 512, generator=torch.Generator().manual_seed(1))
    x_mid = torch.randn(8, 64, 512, generator=torch.Generator().manual_seed(3))

    def megatron(model, mesh):
        plan = {}
        for i in range(len(model.blocks)):
            plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "gate", "up")})
            plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "down")})
        return parallelize_module(model, mesh, plan)

    def fsdp(model, mesh):
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def two_d():
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        return fsdp(megatron(copy.deepcopy(base), mesh["tp"]), mesh["dp"])

    return {
        "DDP, (8,1), batch 64x64": (lambda: DistributedDataParallel(copy.deepcopy(base)), x_large.chunk(world)[rank],
                                    (world, 1), x_large),
        "FSDP2 fully_shard, (8,1), batch 64x64": (lambda: fsdp(copy.deepcopy(base), init_device_mesh("cpu", (world,))),
                                                  x_large.chunk(world)[rank], (world, 1), x_large),
        "parallelize_module Megatron, (1,8), batch 1x64": (
            lambda: megatron(copy.deepcopy(base), init_device_mesh("cpu", (world,))), x_small, (1, world), x_small),
        "FSDP2 x Megatron 2-D, (2,4), batch 8x64": (two_d, x_mid.chunk(2)[rank // (world // 2)], (2, world // 2),
                                                     x_mid),
    }


def run(rank: int, world: int, args) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Model()
    rows = []
    for name, (build, peer_x, mesh, x) in _peers(base, world, rank).items():
        variants = [("", False)] + ([(" compiled", True)] if args.compile else [])
        for suffix, compiled in variants:
            sides = {}
            try:
                peer_mod = build()
                run_peer = torch.compile(peer_mod) if compiled else peer_mod
                sides["peer"] = _trainer(run_peer, torch.optim.AdamW(peer_mod.parameters(), lr=1e-4), peer_x)
                sides["peer"]()  # a peer torch cannot run here fails now, not inside the timing
            except Exception as e:  # noqa: BLE001 - a peer torch cannot run here is reported, not fatal
                sides.pop("peer", None)
                if rank == 0:
                    print(f"{name}{suffix}: the peer did not run ({type(e).__name__}: {str(e)[:160]})")
            for label, options in (("overlap", {}), ("blocking", {"overlap": False})):
                pm = _autopar(base, x, mesh, compile=compiled, **options)
                sides[label] = _trainer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), x)
            timed = median_steps_s(sides, args.steps)
            rows.append((name + suffix, timed.get("peer", float("nan")), timed, pm.plan))
    if rank == 0:
        for name, peer, timed, plan in rows:
            print(f"{name}: peer {peer * 1e3:.1f} ms, autopar {timed['overlap'] * 1e3:.1f} ms "
                  f"(blocking collectives {timed['blocking'] * 1e3:.1f} ms), ratio {timed['overlap'] / peer:.2f}")
            print("  autopar plan: " + plan.summary().splitlines()[2].strip())
        two_d = [t["overlap"] / p for n, p, t, _ in rows if "(2,4)" in n and p == p]
        if two_d:
            print(f"(2,4): autopar/hand-written 2-D plan {max(two_d):.2f} (goal <= 0.85)")
        ratios = [t["overlap"] / p for _, p, t, _ in rows if p == p]
        print(f"worst autopar/peer ratio: {max(ratios):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="also time every side under torch.compile")
    launch(run, p.parse_args(), 8, timeout_s=3600)


if __name__ == "__main__":
    main()
