"""What a call with a new batch or sequence length costs, with and without
Options.dynamic: tiny GPT-2 (2 layers, hidden 64) on gloo ranks, one torch thread each.

    python bench/dynamic_sizes.py [--mesh 2] [--family gpt2]
    python bench/dynamic_sizes.py --llama3-8b     # offline, the model on meta, (2, 4), h100 preset

The same module is called at (4, 8) (the plan), then at five new (batch, seq) sizes.
Without dynamic every new size traces and solves again; with dynamic=True the first
plan's program serves them all. Prints per size the seconds of its first call (slowest
rank) and, at the end, the traces and solves each way. --llama3-8b times a static trace
and plan (what each new size costs without dynamic), the one dynamic trace and plan,
and the check that decides whether a call's sizes are served."""

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


def llama3_8b() -> None:
    import transformers as T

    from autopar.api import plan
    from autopar.core.dynamic import Dynamic
    from autopar.passes.trace import dynamic as D
    from autopar.passes.trace.trace import flatten_inputs, trace
    warnings.simplefilter("ignore")
    cfg = T.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg).eval()

    def ids(b: int, s: int) -> dict:
        return {"input_ids": torch.zeros(b, s, dtype=torch.long, device="meta")}
    t0 = time.perf_counter()
    static = plan(model, (), ids(8, 2048), mesh=(2, 4), device="h100")
    t1 = time.perf_counter()
    dynamic = Dynamic(batch=(1, 64), seq=(16, 8192))
    planned = plan(model, (), ids(8, 2048), mesh=(2, 4), device="h100", dynamic=dynamic)
    t2 = time.perf_counter()
    print(f"llama3-8b shape (2, 4) h100: static trace+plan {t1 - t0:.1f}s per size; dynamic trace+plan {t2 - t1:.1f}s "
          f"once; objective static {static.solver.objective_s:.6g} s, dynamic {planned.solver.objective_s:.6g} s")
    tensors, spec, consts = flatten_inputs((), ids(8, 2048))
    marked = D.marked_dims(tensors, dynamic)
    shapes = D.export_shapes(tensors, marked, {n: dynamic.range_of(n) for n in set(marked.values())})
    dyn_traced = trace(model, (), ids(8, 2048), dynamic_shapes=shapes)  # the graph `planned` was made for
    assert dyn_traced.fingerprint == planned.fingerprint
    signature = D.DynamicSignature.of((str(spec), repr(consts)), tensors, dyn_traced.symbolic,
                                      D.divisors(dyn_traced.gm, planned))
    for b, s in [(16, 1024), (8, 4096), (4, 2048), (3, 2048)]:
        ts, sp, cs = flatten_inputs((), ids(b, s))
        t = time.perf_counter()
        refusal = signature.refusal((str(sp), repr(cs)), ts)
        took = time.perf_counter() - t
        print(f"  ({b}, {s}): {'served' if refusal is None else refusal.reason}; checked in {took * 1e3:.2f} ms")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="2")
    p.add_argument("--family", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--llama3-8b", action="store_true")
    ns = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ns.llama3_8b:
        llama3_8b()
    else:
        launch(run, ns, mesh_size(ns.mesh))
