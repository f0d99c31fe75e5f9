"""Measured costs: a compute profile (op timings at local shapes) and a communication
calibration (alpha and beta per mesh axis and collective), kept in one JSON file.

    {"schema": "autopar.profile", "schema_version": 1, "device": "cpu", "torch_version": ..,
     "created": "2026-11-30T04:10:00Z", "cpu_contention": 4.0,
     "compute": {"<op>|<input shapes:dtypes>|<output shapes>": seconds, ...},
     "comm": {"<axis>:<collective>": {"alpha_s": .., "beta_s_per_byte": .., "residual": .., "ranks": n}}}

Compute keys name the ATen op and its local shapes and dtypes; the device and torch
version are the file's. The planner looks timings up and falls back to the analytic
roofline for missing ones, counting how many it did.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Optional

import torch

from autopar.placement import TensorMeta
from autopar.cost_models.devices import Link

SCHEMA, VERSION = "autopar.profile", 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def compute_key(target: Any, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> str:
    fmt = lambda ms: ";".join(f"{'x'.join(map(str, m.shape))}:{str(m.dtype).removeprefix('torch.')}" for m in ms)  # noqa: E731
    return f"{target}|{fmt(inputs)}|{fmt(outputs)}"


@dataclass
class Profile:
    device: str
    torch_version: str = torch.__version__
    created: str = ""
    compute: dict[str, float] = field(default_factory=dict)
    comm: dict[str, dict] = field(default_factory=dict)
    # ranks per core when run on a CPU host (timings are taken by one rank alone; at run
    # time that many ranks share each core); 1.0 on GPUs
    cpu_contention: float = 1.0
    misses: set = field(default_factory=set)  # compute keys looked up and not found

    # ---- lookups the cost model makes --------------------------------------------
    def compute_s(self, target: Any, inputs: tuple, outputs: tuple) -> Optional[float]:
        key = compute_key(target, inputs, outputs)
        value = self.compute.get(key)
        if value is None:
            self.misses.add(key)
        return value

    def links(self, mesh_shape: tuple[int, ...]) -> dict[tuple[int, str], Link]:
        out = {}
        for key, fit in self.comm.items():
            axis, kind = key.split(":")
            if int(axis) < len(mesh_shape) and fit.get("ranks") == mesh_shape[int(axis)]:
                out[(int(axis), kind)] = Link(fit["alpha_s"], fit["beta_s_per_byte"], f"measured {key}")
        return out

    # ---- files ---------------------------------------------------------------------
    def to_json(self, path: str) -> None:
        from autopar.plan_io import write_json_atomic
        write_json_atomic(path, {"schema": SCHEMA, "schema_version": VERSION, "device": self.device,
                                 "torch_version": self.torch_version,
                                 "created": self.created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 "cpu_contention": self.cpu_contention, "compute": self.compute,
                                 "comm": self.comm})

    @staticmethod
    def from_json(path: str) -> "Profile":
        from autopar.plan_io import PlanFileError
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise PlanFileError(f"profile {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise PlanFileError(f"profile {path} is corrupt ({e}); delete it to measure again") from None
        if d.get("schema") != SCHEMA or d.get("schema_version") != VERSION:
            raise PlanFileError(f"{path} is not an autopar profile of schema version {VERSION}")
        return Profile(d["device"], d.get("torch_version", ""), d.get("created", ""), dict(d["compute"]),
                       dict(d.get("comm", {})), float(d.get("cpu_contention", 1.0)))


# ---- 1. compute profiling --------------------------------------------------------

def _example(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    if meta.dtype.is_floating_point:
        return torch.randn(meta.shape, device=device).to(meta.dtype)
    return torch.zeros(meta.shape, dtype=meta.dtype, device=device)  # valid indices and masks


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of fn(): CUDA events on a GPU, a monotonic clock on the CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@dataclass(frozen=True)
class OpSample:
    """One distinct (op, local shapes) a plan could run, with arguments to replay it."""

    key: str
    target: Any
    args: tuple  # TensorArg markers where tensors go
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]


def samples_of(graph, mesh_shape: tuple[int, ...]) -> list[OpSample]:
    """Every distinct op call at the local shapes of every candidate strategy."""
    from autopar.passes.rewrite import localize_call
    origin = (0,) * len(mesh_shape)  # what rank 0 runs; every rank runs the same shapes
    seen: dict[str, OpSample] = {}
    for n in graph.nodes:
        if n.call is None:
            continue
        for s in n.strategies:
            ins = tuple(TensorMeta(x.local_shape(mesh_shape), x.meta.dtype) for x in s.inputs)
            outs = tuple(TensorMeta(x.local_shape(mesh_shape), x.meta.dtype) for x in s.outputs)
            key = compute_key(n.call.target, ins, outs)
            if key not in seen:
                target, args = localize_call(n.call.target, n.call.args, s.inputs, s.outputs, mesh_shape, origin)
                seen[key] = OpSample(key, target, args, n.call.kwargs, ins, outs)
    return list(seen.values())


def profile_compute(samples: Iterable[OpSample], profile: Profile, device: torch.device,
                    budget_s: float = 120.0, progress: bool = True) -> int:
    """Time the samples the profile lacks; returns how many were measured. Stops when
    the time budget is spent (the rest fall back to the analytic model)."""
    from autopar import _compat
    from autopar.passes.rules import TensorArg
    todo = [s for s in samples if s.key not in profile.compute]
    t0 = time.monotonic()
    measured = 0
    for i, s in enumerate(todo):
        if time.monotonic() - t0 > budget_s:
            if progress:
                print(f"autopar: profiling budget of {budget_s:.0f} s spent; {len(todo) - i} op timings left to the "
                      "analytic model", file=sys.stderr)
            break
        tensors = [_example(m, device) for m in s.inputs]
        leaves, tree = _compat.tree_flatten((s.args, s.kwargs))
        filled = [tensors[x.index] if isinstance(x, TensorArg) else x for x in leaves]
        args, kwargs = _compat.tree_unflatten(filled, tree)
        try:
            with torch.no_grad():
                profile.compute[s.key] = time_call(lambda: s.target(*args, **kwargs), device)
            measured += 1
        except Exception:  # noqa: BLE001 - an op that cannot replay in isolation keeps its analytic cost
            continue
        if progress and len(todo) > 50 and (i + 1) % 100 == 0:
            print(f"autopar: profiled {i + 1}/{len(todo)} op shapes", file=sys.stderr)
    return measured


def measure_contention(device: torch.device, group=None) -> float:
    """How much slower a fixed mix of small and large ops runs when every rank of this
    host runs it at once than when rank 0 runs it alone (every rank must call this).
    On a CPU host with more ranks than cores this is the compute term's correction."""
    import torch.distributed as dist
    a, b = torch.randn(128, 128, device=device), torch.randn(256, 256, device=device)

    def work():
        x = a
        for _ in range(100):
            x = torch.relu(x + 1.0) * 0.5  # many small ops: dispatch overhead
        for _ in range(5):
            b @ b  # a few large ones: arithmetic
    alone = torch.zeros(1, dtype=torch.float64)
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        alone[0] = time_call(work, device, warmup=2, repeats=7)
    dist.broadcast(alone, src=0, group=group)
    dist.barrier(group=group)
    together = torch.tensor([time_call(work, device, warmup=2, repeats=7)], dtype=torch.float64)
    dist.all_reduce(together, op=dist.ReduceOp.MAX, group=group)
    return max(1.0, float(together[0] / alone[0]))


# ---- 2. communication calibration ------------------------------------------------

RING = {  # collective -> (alpha steps, beta factor) on n ranks, as in cost_models/comm.py
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_to_all": (lambda n: n - 1, lambda n: (n - 1) / n),
}


def fit_alpha_beta(sizes: list[int], seconds: list[float], n: int, kind: str) -> dict:
    """Least squares t = a + b * bytes in relative error (weights 1/t^2: the sizes span
    four orders of magnitude, and a plain fit would ignore the small messages), read as
    the ring model's alpha and beta; the residual is the relative RMS error of the fit."""
    m = len(sizes)
    w = [1.0 / (y * y) for y in seconds]
    sw, swx = sum(w), sum(wi * x for wi, x in zip(w, sizes))
    swxx = sum(wi * x * x for wi, x in zip(w, sizes))
    swy, swxy = sum(wi * y for wi, y in zip(w, seconds)), sum(wi * x * y for wi, x, y in zip(w, sizes, seconds))
    det = sw * swxx - swx * swx
    a = (swxx * swy - swx * swxy) / det
    b = (sw * swxy - swx * swy) / det
    if a <= 0 or b <= 0:  # keep the physics: a latency and a bandwidth term, both positive
        b = max(b, 1e-15)
        a = max(min(seconds) - b * sizes[seconds.index(min(seconds))], 1e-7)
    pred = [a + b * x for x in sizes]
    residual = (sum(((p - y) / y) ** 2 for p, y in zip(pred, seconds)) / m) ** 0.5
    steps, factor = RING[kind]
    return {"alpha_s": a / steps(n), "beta_s_per_byte": b / factor(n), "residual": residual, "ranks": n}


def calibrate(comms, device: torch.device, sizes: Optional[list[int]] = None, repeats: int = 5) -> dict:
    """Time each collective along each mesh axis (every rank must call this) and fit."""
    import torch.distributed as dist
    from autopar.collectives import _all_gather, _all_reduce, _all_to_all, _reduce_scatter
    sizes = sizes or [4 << 10, 64 << 10, 1 << 20, 4 << 20, 32 << 20]
    out = {}
    for axis, comm in enumerate(comms):
        if comm.size == 1:
            continue
        runs = {"all_reduce": lambda x: _all_reduce(x, comm), "all_gather": lambda x: _all_gather(x, 0, comm),
                "reduce_scatter": lambda x: _reduce_scatter(x, 0, comm),
                "all_to_all": lambda x: _all_to_all(x, 0, 0, comm)}
        for kind, run in runs.items():
            seconds = []
            for nbytes in sizes:
                numel = max(nbytes // 4 // comm.size * comm.size, comm.size)
                x = torch.randn(numel, device=device)
                dist.barrier(group=comm.group)
                seconds.append(time_call(lambda: run(x), device, warmup=1, repeats=repeats))
            # every rank of the axis must agree on the fit: use the slowest rank's times
            t = torch.tensor(seconds, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
            payload = [max(nbytes // 4 // comm.size * comm.size, comm.size) * 4 for nbytes in sizes]
            if kind == "all_gather":
                payload = [p * comm.size for p in payload]  # the gathered result's bytes
            out[f"{axis}:{kind}"] = fit_alpha_beta(payload, t.tolist(), comm.size, kind)
    return out
