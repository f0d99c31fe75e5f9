"""One short multi-rank job of bench/soak.py, written as a user writes one: torchrun
starts it, it initialises the default group, compiles, runs, compares with one device,
writes what it found and returns (no barrier, no destroy_process_group of its own,
unless --destroy). The exit code is the job's verdict as a scheduler sees it.

    torchrun --nproc-per-node 2 bench/soak_job.py train --out DIR

Kinds: train (AdamW steps with overlapped gradient buckets, then full_state_dict),
checkpoint (train, save a training checkpoint, resume it in a fresh module, one more
step on each), pipeline (two pipeline stages), generate (greedy decoding), compile
(a training step under torch.compile), mixed (several models one after another).
Each rank writes DIR/rank<r>.json: {"kind", "match", "detail"} once its work is done,
so an exit code other than 0 after that file is an abort at teardown.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
from autopar.tools.simulated import CHEAP_COMM  # noqa: E402
from tests import models  # noqa: E402

KINDS = ("train", "checkpoint", "pipeline", "generate", "compile", "mixed")
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # fp32, sums over 2-8 ranks in another order


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.detach().float(), b.detach().float(), **TOLERANCE))


def _train(model_name: str, mesh: tuple, steps: int, compile_: bool = False) -> tuple[bool, str, object]:
    model = models.build(model_name).train()
    reference = copy.deepcopy(model)
    args, kwargs = models.inputs(model_name, batch=4)
    pm = autopar.compile(model, mesh=mesh, device=CHEAP_COMM, compile=compile_)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ok, losses = True, []
    for _ in range(steps):
        loss = pm(*args, **kwargs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(*args, **kwargs).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ok &= _close(loss, ref_loss)
        losses.append(round(float(loss), 6))
    state = pm.full_state_dict()
    ok &= all(_close(state[k], v) for k, v in reference.state_dict().items() if k in state)
    return ok, f"losses {losses}", pm


def train(args: argparse.Namespace) -> tuple[bool, str]:
    ok, detail, _ = _train("gpt2", (dist.get_world_size(),), steps=3)
    return ok, detail


def compile_job(args: argparse.Namespace) -> tuple[bool, str]:
    ok, detail, _ = _train("gpt2", (dist.get_world_size(),), steps=2, compile_=True)
    return ok, detail


def checkpoint(args: argparse.Namespace) -> tuple[bool, str]:
    root = os.path.join(args.out, "checkpoints")
    model = models.build("gpt2").train()
    batch_args, kwargs = models.inputs("gpt2", batch=4)
    pm = autopar.compile(model, batch_args, kwargs, mesh=(dist.get_world_size(),), device=CHEAP_COMM)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(2):
        pm(*batch_args, **kwargs).loss.backward()
        opt.step()
        opt.zero_grad()
    autopar.save_training_checkpoint(pm, opt, root, 2)
    again = autopar.compile(models.build("gpt2", seed=5).train(), batch_args, kwargs,
                            mesh=(dist.get_world_size(),), device=CHEAP_COMM)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    resumed = autopar.resume(again, opt2, root)
    losses = []
    for p, o in ((pm, opt), (again, opt2)):
        loss = p(*batch_args, **kwargs).loss
        loss.backward()
        o.step()
        losses.append(loss)
    ok = resumed is not None and resumed.step == 2 and _close(losses[0], losses[1])
    return ok, f"resumed at {resumed.step if resumed else None}, losses {[round(float(x), 6) for x in losses]}"


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def pipeline(args: argparse.Namespace) -> tuple[bool, str]:
    world = dist.get_world_size()
    model = models.build("gpt2", n_layer=2).train()
    reference = copy.deepcopy(model)
    ids = models.inputs("gpt2", batch=4)[1]["input_ids"]
    pipe = autopar.compile(model, (), {"input_ids": ids}, mesh=(2, world // 2), device=CHEAP_COMM,
                           pipeline_axis=0, microbatches=2, training=True, loss_fn=_lm_loss)
    loss = pipe.step(input_ids=ids, target=ids)
    ref = _lm_loss(reference(input_ids=ids).logits, ids)
    ok = loss is None or _close(loss, ref)  # the last stage's ranks hold the loss
    return ok, f"loss {None if loss is None else round(float(loss), 6)} against {round(float(ref), 6)}"


def generate(args: argparse.Namespace) -> tuple[bool, str]:
    model = models.build("llama")
    ids = models.inputs("llama", batch=2, seq=4)[1]["input_ids"]
    gen = autopar.compile_for_generation(model, mesh=(dist.get_world_size(),), max_batch=2, max_cache_len=16,
                                         device=CHEAP_COMM)
    tokens = gen.generate(ids, max_new_tokens=4)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4, use_cache=True,
                                  pad_token_id=0)
    return bool(torch.equal(tokens, expected)), f"tokens {tokens.tolist()}"


def mixed(args: argparse.Namespace) -> tuple[bool, str]:
    results = [_train(name, (dist.get_world_size(),), steps=1)[0] for name in ("gpt2", "llama", "bert")]
    return all(results), f"{len(results)} models"


JOBS = {"train": train, "checkpoint": checkpoint, "pipeline": pipeline, "generate": generate,
        "compile": compile_job, "mixed": mixed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--destroy", action="store_true", help="call destroy_process_group at the end")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    ok, detail = JOBS[args.kind](args)
    rank = dist.get_rank()
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"kind": args.kind, "match": bool(ok), "detail": detail}, f)
    os.replace(path + ".tmp", path)
    if args.destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
