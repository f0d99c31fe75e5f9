"""What agreeing on every call's inputs costs (autopar/runtime/call_agreement.py):
the agreement alone (one all-reduce of two int64: a hash and its negation) against a whole training step
of a small model on the same ranks, taking turns, one torch thread per rank.

    python bench/call_agreement.py [--ranks 8] [--steps 20]

Prints the median agreement, the median step (agreement included) and their ratio;
last line 'agreement/step: <x>'."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from _launch import launch  # noqa: E402
from _timing import median_steps_s  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.call_agreement import CallSignature, agree_on_call  # noqa: E402
from autopar.runtime.shipping import Inputs  # noqa: E402
from tests import models  # noqa: E402


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = models.build("gpt2").train()
    _, kwargs = models.inputs("gpt2", batch=world, seq=16)
    pm = autopar.compile(model, (), kwargs, mesh=(world,))
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def step() -> None:
        pm(**kwargs).loss.backward()
        opt.step()
        opt.zero_grad()

    def agreement() -> None:
        agree_on_call(CallSignature(Inputs.of((), kwargs), True, True), 0, pm.span)

    timed = median_steps_s({"agreement": agreement, "step": step}, args.steps)
    if rank == 0:
        print(f"{world} gloo ranks, GPT-2 2 x 32, batch {world} x 16, SGD")
        print(f"agreement {timed['agreement'] * 1e3:.3f} ms, training step {timed['step'] * 1e3:.1f} ms")
        print(f"agreement/step: {timed['agreement'] / timed['step']:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    launch(run, args, args.ranks, timeout_s=600)


if __name__ == "__main__":
    main()
