"""What autopar's rank program adds to the step when the math is the same as a peer's.

    python bench/rank_overhead.py [--part one-rank|bf16|ddp|all] [--steps 12] [--ranks 8]

1. one-rank: mesh (1,) on one gloo rank against the plain model in the same process, the
   forward under no_grad and the training step (forward, backward, optimiser), each with
   SGD and AdamW. The plan has nothing to split, so any difference is the rank program's.
2. bf16: the one-rank training step with param_dtype=bfloat16 against the plain model
   under torch.autocast(bfloat16), AdamW.
3. ddp: mesh (N, 1) on N gloo ranks against DistributedDataParallel, where autopar's plan
   is DDP's (batch split, parameters replicated, gradients all-reduced in buckets during
   backward), with full batches (every rank passes the whole batch, autopar cuts its rows)
   and with local batches (local_inputs=True: each rank passes its own rows, as DDP's
   loader does). Each row also prints DDP with its loss all-reduced in forward, the loss
   autopar returns (the global batch's), as the like-for-like reference beside DDP's own.

Models (Llama-shaped blocks from bench/_blocks.py, mean-square loss): narrow and deep
(8 x 128), the issue's shape (4 x 256) and wide and shallow (1 x 1024). One torch thread
per rank on every side; the sides take turns step by step (bench/_timing.py). Prints one
line per row with the medians (slowest rank) and the ratio autopar/peer, and last
'worst <part> ratio: <x>' per part (targets: one-rank 1.03, bf16 1.05, ddp 1.02)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _launch import launch  # noqa: E402
from _timing import median_steps_s  # noqa: E402
from _blocks import Model  # noqa: E402

SHAPES = {  # name -> (layers, hidden, heads, ffn, global batch, seq): two rows per rank on 8
    "narrow-deep 8x128": (8, 128, 2, 384, 16, 128),
    "llama 4x256": (4, 256, 4, 768, 16, 128),  # the point
    "wide-shallow 1x1024": (1, 1024, 8, 2816, 16, 64),
}
OPTIMISERS = {"SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3), "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4)}


def _compile(model, x, mesh):
    import autopar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(copy.deepcopy(model).train(), (x,), mesh=mesh)


def _train(module, make_opt, x, local: bool = False):
    opt = make_opt(module.parameters())
    kwargs = {"local_inputs": True} if local else {}

    def step() -> None:
        module(x, **kwargs).backward()
        opt.step()
        opt.zero_grad()
    return step


def _forward(module, x):
    def step() -> None:
        with torch.no_grad():
            module(x)
    return step


def one_rank(rank: int, world: int, args) -> None:
    torch.set_num_threads(1)
    ratios = []
    for shape, (layers, hidden, heads, ffn, batch, seq) in SHAPES.items():
        torch.manual_seed(0)
        base = Model(layers, hidden, heads, ffn)
        x = torch.randn(batch // 8, seq, hidden)  # one rank's share of the (8, 1) batch
        pm = _compile(base, x, (1,))
        assert not any(pm.plan.collectives()), "a (1,) plan has no collectives"
        sides = {"plain fwd": _forward(base, x), "autopar fwd": _forward(pm, x)}
        for name, make_opt in OPTIMISERS.items():
            sides[f"plain {name}"] = _train(copy.deepcopy(base), make_opt, x)
            sides[f"autopar {name}"] = _train(_compile(base, x, (1,)), make_opt, x)
        timed = median_steps_s(sides, args.steps)
        for what in ("fwd", *OPTIMISERS):
            mine, plain = timed[f"autopar {what}"], timed[f"plain {what}"]
            ratios.append(mine / plain)
            label = "forward" if what == "fwd" else f"train {what}"
            print(f"one rank (1,), {shape}, batch {x.shape[0]}x{seq}, {label:<11}: plain {plain * 1e3:7.2f} ms, "
                  f"autopar {mine * 1e3:7.2f} ms, ratio {mine / plain:.3f}", flush=True)
    print(f"worst one-rank ratio: {max(ratios):.3f}", flush=True)


def bf16(rank: int, world: int, args) -> None:
    """Item 2 of the issue: a one-rank step with Options.param_dtype=bfloat16 (bf16 copies
    of the fp32 master weights, fp32 gradient reduction) against the plain model under
    torch.autocast(bfloat16), AdamW."""
    torch.set_num_threads(1)
    ratios = []
    for shape, (layers, hidden, heads, ffn, batch, seq) in SHAPES.items():
        torch.manual_seed(0)
        base = Model(layers, hidden, heads, ffn)
        x = torch.randn(batch // 8, seq, hidden)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import autopar
            pm = autopar.compile(copy.deepcopy(base).train(), (x,), mesh=(1,), param_dtype=torch.bfloat16,
                                 reduce_dtype=torch.float32)
        plain_step = _train(copy.deepcopy(base), OPTIMISERS["AdamW"], x)

        def autocast_step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                plain_step()
        timed = median_steps_s({"autocast": autocast_step, "autopar": _train(pm, OPTIMISERS["AdamW"], x)}, args.steps)
        ratios.append(timed["autopar"] / timed["autocast"])
        print(f"one rank (1,), {shape}, batch {x.shape[0]}x{seq}, bf16 AdamW: autocast {timed['autocast'] * 1e3:7.2f} ms, "
              f"autopar param_dtype=bf16 {timed['autopar'] * 1e3:7.2f} ms, ratio {ratios[-1]:.3f}", flush=True)
    print(f"worst bf16 ratio: {max(ratios):.3f}", flush=True)


class _GlobalLoss(torch.nn.Module):
    """DDP returning the loss autopar returns, the mean over the global batch: its own
    loss all-reduced in forward (blocking, as a value the caller may read at once), for
    the row that compares like with like; DDP's own loss is the rank's."""

    def __init__(self, ddp_model: torch.nn.Module) -> None:
        super().__init__()
        self.ddp = ddp_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        loss = self.ddp(x)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return loss + (total / dist.get_world_size() - loss.detach())


def ddp(rank: int, world: int, args) -> None:
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    ratios = []
    for shape, (layers, hidden, heads, ffn, batch, seq) in SHAPES.items():
        torch.manual_seed(0)
        base = Model(layers, hidden, heads, ffn)
        x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1))
        mine = x.chunk(world)[rank]
        for name, make_opt in OPTIMISERS.items():
            sides = {"ddp": _train(DistributedDataParallel(copy.deepcopy(base)), make_opt, mine),
                     "ddp+loss": _train(_GlobalLoss(DistributedDataParallel(copy.deepcopy(base))), make_opt, mine),
                     "full": _train(_compile(base, x, (world, 1)), make_opt, x),
                     "local": _train(_compile(base, x, (world, 1)), make_opt, mine, local=True)}
            timed = median_steps_s(sides, args.steps)
            if rank == 0:
                for side in ("full", "local"):
                    ratios.append(timed[side] / timed["ddp"])
                    print(f"({world}, 1) vs DDP, {shape}, batch {x.shape[0]}x{seq}, {name:<5}, {side} batches: "
                          f"DDP {timed['ddp'] * 1e3:7.1f} ms, autopar {timed[side] * 1e3:7.1f} ms, "
                          f"ratio {timed[side] / timed['ddp']:.3f} (DDP with its loss all-reduced "
                          f"{timed['ddp+loss'] * 1e3:7.1f} ms, ratio {timed[side] / timed['ddp+loss']:.3f})", flush=True)
    if rank == 0:
        print(f"worst ddp ratio: {max(ratios):.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["one-rank", "bf16", "ddp", "all"], default="all")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ranks", type=int, default=8)
    args = p.parse_args()
    if args.part in ("one-rank", "all"):
        launch(one_rank, args, 1, timeout_s=3600)
    if args.part in ("bf16", "all"):
        launch(bf16, args, 1, timeout_s=3600)
    if args.part in ("ddp", "all"):
        launch(ddp, args, args.ranks, timeout_s=3600)


if __name__ == "__main__":
    main()
