"""autopar's pipelined plan vs a hand-written torch.distributed.pipelining split.

The same GPT-2-shaped model (8 layers) on 8 gloo ranks, pipelined over all of them
(mesh (8,), pipeline_axis=0: one block per stage), the same schedule and microbatches.
The hand version splits with pipeline(split_spec) at every block and drives the raw
stage modules with the schedule; autopar plans the stages, runs each as a ParallelModule
on its (one-rank) sub-mesh and wraps it in PipelineStage. Timed: training steps (all
microbatches, forward, loss, backward), median over --steps after --warmup, the slowest
rank's time per step, the two alternating step by step.

    python bench/pipeline_speed.py [--steps 10] [--warmup 2] [--schedule 1f1b] [--microbatches 8]

Last line: 'autopar/hand pipeline ratio: X' (goal <= 1.00).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed import pipelining as pp  # noqa: E402

WORLD = 8


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build(batch: int, seq: int):
    import transformers as T
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=WORLD, n_embd=128, n_head=4, vocab_size=512, n_positions=seq, attn_pdrop=0.0,
                       resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, tie_word_embeddings=False)
    model = T.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, ids


def hand_schedule(model, ids, microbatches: int, schedule: str, rank: int):
    """The hand-written split: one block per rank, torch's own stage and schedule."""
    split = {f"transformer.h.{i}": pp.SplitPoint.BEGINNING for i in range(1, WORLD)}
    pipe = pp.pipeline(model, mb_args=(), mb_kwargs={"input_ids": ids[: ids.shape[0] // microbatches]},
                       split_spec=split)
    stage = pipe.build_stage(rank, torch.device("cpu"))
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule]
    return cls(stage, n_microbatches=microbatches, loss_fn=lm_loss)


def timed(step) -> float:
    """One step's seconds on the slowest rank."""
    dist.barrier()
    t = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - t])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(rank: int, store: str, args: argparse.Namespace, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    import autopar
    model, ids = build(args.batch, args.seq)
    first, last = rank == 0, rank == WORLD - 1
    feed = {"input_ids": ids} if first else {}
    hand = hand_schedule(model, ids, args.microbatches, args.schedule, rank)
    model, ids = build(args.batch, args.seq)  # a fresh copy of the same weights for autopar
    pipe = autopar.compile(model, (), {"input_ids": ids}, mesh=(WORLD,), pipeline_axis=0,
                           microbatches=args.microbatches, pipeline_schedule=args.schedule, loss_fn=lm_loss,
                           training=True)
    hand_times, autopar_times = [], []
    for i in range(args.warmup + args.steps):  # alternating, so both see the same machine
        h = timed(lambda: hand.step(**feed, target=ids if last else None))
        a = timed(lambda: pipe.step(**feed, target=ids if last else None))
        if i >= args.warmup:
            hand_times.append(h)
            autopar_times.append(a)
    if rank == 0:
        stages = [(s.first, s.stop) for s in pipe.plan.pipeline.stages]
        with open(out, "w") as f:
            f.write(f"{statistics.median(hand_times)} {statistics.median(autopar_times)} {stages}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(worker, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD, start_method="spawn")
        hand_s, autopar_s, stages = open(out).read().split(" ", 2)
    hand_s, autopar_s = float(hand_s), float(autopar_s)
    print(f"GPT-2 {WORLD} layers, n_embd 128, batch {args.batch} x seq {args.seq}, {args.microbatches} microbatches, "
          f"{args.schedule}, {WORLD} gloo ranks; autopar stages (blocks) {stages.strip()}")
    print(f"hand-written torch.distributed.pipelining: {hand_s * 1e3:.1f} ms/step (median of {args.steps})")
    print(f"autopar pipelined plan:                     {autopar_s * 1e3:.1f} ms/step")
    print(f"autopar/hand pipeline ratio: {autopar_s / hand_s:.2f}")


if __name__ == "__main__":
    sys.exit(main())
