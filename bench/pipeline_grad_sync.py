"""A pipeline with data parallelism inside its stages: the stages' gradient all-reduce once
per step (Options.grad_sync_every = microbatches, what autopar runs) against once per
microbatch (what it ran before), the same plan on both sides.

GPT-2-shaped (8 layers) on 8 gloo ranks, mesh (4, 2): 4 pipeline stages of 2 blocks, each
stage data parallel over its 2 ranks, 1F1B. Both sides run rank 0's one plan (the second
is given the first's); the per-microbatch side builds its stages with grad_sync_every=1.
Timed: training steps (all microbatches, forward, loss, backward), the slowest rank's time,
the two sides taking turns step by step, one torch thread per rank; medians over --steps
after --warmup. The gradients of both sides are compared after the last step.

    python bench/pipeline_grad_sync.py [--steps 10] [--warmup 2] [--microbatches 8] [--width 256]

Last line: 'once-per-step/per-microbatch ratio: X' (below 1: the saving).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import warnings
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import importlib.util  # noqa: E402

# the loss and the slowest-rank step timer of the sibling bench (a file beside this one, not a package)
_spec = importlib.util.spec_from_file_location("pipeline_speed", os.path.join(os.path.dirname(__file__),
                                                                              "pipeline_speed.py"))
_sibling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sibling)
lm_loss, timed = _sibling.lm_loss, _sibling.timed

WORLD, MESH = 8, (4, 2)


def build(batch: int, seq: int, width: int):
    import transformers as T
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=8, n_embd=width, n_head=4, vocab_size=512, n_positions=seq, attn_pdrop=0.0,
                       resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, tie_word_embeddings=False)
    model = T.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, ids


def per_microbatch(compile_pipeline):
    """compile_pipeline() with the stages reducing after every microbatch's backward."""
    import autopar.runtime.stages as stages
    once = stages.stage_options
    stages.stage_options = lambda options: dataclasses.replace(once(options), grad_sync_every=1)
    try:
        return compile_pipeline()
    finally:
        stages.stage_options = once


def grads(pipe) -> dict:
    return {n: p.grad.clone() for s in pipe.stages.stages for n, p in s.pm.shards.named_parameters()
            if p.grad is not None}


def worker(rank: int, store: str, args: argparse.Namespace, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    import autopar
    options = autopar.Options(pipeline_axis=0, microbatches=args.microbatches, pipeline_schedule="1f1b",
                              training=True)

    def compile_pipeline(plan=None):
        model, ids = build(args.batch, args.seq, args.width)
        return autopar.compile(model, (), {"input_ids": ids}, mesh=MESH, options=options, loss_fn=lm_loss, plan=plan)
    once = compile_pipeline()
    each = per_microbatch(lambda: compile_pipeline(once.plan))
    ids = build(args.batch, args.seq, args.width)[1]
    sides = {"once": once, "each": each}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(args.warmup + args.steps):  # taking turns, so both see the same machine
        for name, pipe in sides.items():
            for s in pipe.stages.stages:
                s.pm.zero_grad(set_to_none=True)
            t = timed(lambda: pipe.step(input_ids=ids, target=ids))
            if i >= args.warmup:
                times[name].append(t)
    a, b = grads(once), grads(each)
    worst = max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in a)
    reductions = [(c.buckets.every, c.buckets.reductions) for s in once.stages.stages for c in s.pm.programs]
    worst_t = torch.tensor([worst])
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{statistics.median(times['once'])} {statistics.median(times['each'])} {worst_t.item()} "
                    f"{reductions} {[(s.first, s.stop) for s in once.plan.pipeline.stages]}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(worker, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD, start_method="spawn")
        once_s, each_s, worst, rest = open(out).read().split(" ", 3)
    once_s, each_s = float(once_s), float(each_s)
    print(f"GPT-2 8 layers, n_embd {args.width}, batch {args.batch} x seq {args.seq}, {args.microbatches} "
          f"microbatches, 1f1b, mesh {MESH} on {WORLD} gloo ranks (stages data parallel over axis 1)")
    print(f"rank 0's stage programs (backwards per reduction, reductions run): {rest.strip()}")
    print(f"gradients, once per step against per microbatch: largest difference / largest gradient {float(worst):.1e}")
    print(f"all-reduce per microbatch: {each_s * 1e3:.1f} ms/step (median of {args.steps})")
    print(f"all-reduce once per step:  {once_s * 1e3:.1f} ms/step")
    print(f"once-per-step/per-microbatch ratio: {once_s / each_s:.2f}")


if __name__ == "__main__":
    sys.exit(main())
