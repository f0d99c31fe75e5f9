"""What a call with a new batch or sequence length costs, with and without
Options.dynamic: tiny GPT-2 (2 layers, hidden 64) on gloo ranks, one torch thread each.

    python bench/dynamic_sizes.py [--mesh 2] [--family gpt2]

The same module is called at (4, 8) (the plan), then at five new (batch, seq) sizes.
Without dynamic every new size traces and solves again; with dynamic=True the first
plan's program serves them all. Prints per size the seconds of its first call (slowest
rank) and, at the end, the traces and solves each way."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import launch, mesh_size  # noqa: E402

SIZES = [(4, 8), (2, 8), (6, 8), (4, 4), (4, 12), (4, 16)]


def run(rank: int, world: int, args) -> None:
    import autopar
    from autopar.tools.simulated import CHEAP_COMM
    from tests import models
    torch.set_num_threads(1)
    mesh = tuple(int(s) for s in args.mesh.split(","))
    wide = {"gpt2": dict(n_embd=64), "llama": dict(hidden_size=64, intermediate_size=128, head_dim=16)}[args.family]
    m = models.build(args.family, **wide)
    for dynamic in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(m, mesh=mesh, device=CHEAP_COMM, dynamic=dynamic)
            row = []
            for b, s in SIZES:
                a, kw = models.inputs(args.family, b, s)
                dist.barrier()
                t0 = time.perf_counter()
                with torch.no_grad():
                    pm(*a, **kw)
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                row.append(f"({b},{s}) {took.item():.3f}s")
        solves = torch.tensor([pm.solve_count])
        dist.all_reduce(solves)
        if rank == 0:
            print(f"dynamic={dynamic}: first call per size: {', '.join(row)}; traces {pm.trace_count}, "
                  f"solves {int(solves.item())}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="2")
    p.add_argument("--family", default="gpt2", choices=["gpt2", "llama"])
    ns = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    launch(run, ns, mesh_size(ns.mesh))
