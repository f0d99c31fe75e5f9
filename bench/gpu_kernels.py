"""Where a one-rank step's GPU time goes, autopar's program beside the plain model: the
kernels of each side's training step under torch.profiler, summed by name.

    python bench/gpu_kernels.py [--dtype bf16|fp32] [--layers 4] [--hidden 1024] [--seq 512] [--batch 8]

The model and step are bench/gpu_step.py's (Llama-shaped, AdamW); bf16 sets autopar's
param_dtype=bf16 beside the plain model under torch.autocast(bf16), fp32 runs both plain.
Prints per side the step's GPU kernel time, CPU time and kernel count, then the kernels
whose total time differs most between the sides (ms per step): the tax to look for; with
--phases, each side's forward, backward and optimiser timed apart (twice, sides in turn)."""

from __future__ import annotations

import argparse
import collections
import copy
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402


def _bench_script(name: str):
    """bench/<name>.py, a sibling script (not a package), loaded by its path."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_step = _bench_script("gpu_step")


def kernels(step, steps: int) -> tuple[dict[str, float], float, int]:
    """(kernel name -> ms per step, CPU ms per step, kernels per step)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, float] = collections.defaultdict(float)
    count = 0
    host = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name[e.name[:90]] += e.time_range.elapsed_us() / 1e3 / steps
            count += 1
        elif e.device_type == DeviceType.CPU:
            host.append(e.time_range)
    span_us = max((r.end for r in host), default=0) - min((r.start for r in host), default=0)
    return dict(by_name), span_us / 1e3 / steps, count // steps


def phases(module, kwargs: dict, autocast: bool, steps: int) -> tuple[float, float, float]:
    """Median (forward, backward, optimiser) ms of a training step, the GPU synchronised
    between phases (each phase's time is the slower of its host dispatch and its kernels)."""
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    rows = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = module(**kwargs).loss
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:
            rows.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return tuple(statistics.median(r[j] for r in rows) * 1e3 for j in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--phases", action="store_true", help="also time forward, backward and optimiser apart")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_kernels.py needs a CUDA device")
    warnings.simplefilter("ignore")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = gpu_step.llama(args.layers, args.hidden)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=gpu_step.CUDA)
    kwargs = {"input_ids": ids, "labels": ids}
    bf16 = args.dtype == "bf16"
    extra = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                device_id=gpu_step.CUDA)
        try:
            pm = autopar.compile(copy.deepcopy(model), (), kwargs, mesh=(1,), device="h200", **extra)
            sides = {"autopar": kernels(gpu_step.train_step(pm, kwargs), args.steps),
                     "plain": kernels(gpu_step.train_step(copy.deepcopy(model), kwargs, autocast=bf16), args.steps)}
            if args.phases:
                for side, module, cast in (("autopar", pm, False), ("plain", copy.deepcopy(model), bf16),
                                           ("autopar", pm, False), ("plain", copy.deepcopy(model), bf16)):
                    fwd, bwd, opt = phases(module, kwargs, cast, 10)
                    print(f"{args.dtype} {side:<8} forward {fwd:7.2f} ms, backward {bwd:7.2f} ms, optimiser {opt:6.2f} ms "
                          "(synchronised between phases)", flush=True)
        finally:
            dist.destroy_process_group()
    for side, (k, cpu_ms, n) in sides.items():
        print(f"{args.dtype} {side:<8} GPU kernels {sum(k.values()):7.2f} ms/step, CPU span {cpu_ms:7.2f} ms/step, "
              f"{n} kernels/step")
    mine, plain = sides["autopar"][0], sides["plain"][0]
    names = sorted(set(mine) | set(plain), key=lambda n: -abs(mine.get(n, 0) - plain.get(n, 0)))
    print(f"{'kernel':<90} {'autopar':>8} {'plain':>8}  ms/step")
    for n in names[:args.top]:
        print(f"{n:<90} {mine.get(n, 0):8.3f} {plain.get(n, 0):8.3f}")


if __name__ == "__main__":
    main()
