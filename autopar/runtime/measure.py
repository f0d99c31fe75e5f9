"""Measuring on this machine and its live process groups, for the profiling cost model.

1. compute: every distinct (op, local shapes) the candidate strategies would run is
   timed here (CUDA events on a GPU, a monotonic clock on a CPU), forward and, for a
   training plan, backward;
2. contention: on a CPU host, how much slower ranks run when they share cores, and what
   each collective costs them in waiting for one another;
3. links: each collective timed along each mesh axis on this rank's own group of that
   axis (so on two nodes the axis inside a node and the axis across them get their own
   figures), fitted to alpha + bytes * beta and tagged with the axis's link kind.
The results go into a Profile (cost_models/profile.py), cached in one JSON file per
device and torch version; the cost model only reads it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from autopar import _compat
from autopar.core.files import read_json, write_json_atomic
from autopar.core.kinds import StepKind
from autopar.core.links import LinkKind
from autopar.core.mesh import Mesh
from autopar.core.placement import TensorMeta
from autopar.cost_models.profile import COLLECTIVES, Profile, compute_key, fit_alpha_beta
from autopar.passes.rewrite import localize_call
from autopar.passes.rules import TensorArg
from autopar.passes.strategies import AnnotatedGraph
from autopar.runtime.collectives import AxisComm, all_gather, all_reduce, all_to_all, reduce_scatter


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


def samples_of(graph: AnnotatedGraph, mesh_shape: tuple[int, ...]) -> list[OpSample]:
    """Every distinct op call at the local shapes of every candidate strategy."""
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
                    budget_s: float = 120.0, progress: bool = True, backward: bool = False) -> int:
    """Time the samples the profile lacks, forward and, with `backward` (a training plan),
    their backward; returns how many forwards were measured. Stops when the time budget
    is spent (the rest fall back to the analytic model, and the backward to the forward
    times compute.backward_factor)."""
    samples = list(samples)
    todo = [s for s in samples if s.key not in profile.compute
            or (backward and s.key not in profile.backward and _differentiable(s))]
    t0 = time.monotonic()
    measured = 0
    call_s = _grad_call_s(device) if backward and todo else 0.0
    for i, s in enumerate(todo):
        if time.monotonic() - t0 > budget_s:
            if progress:
                print(f"autopar: profiling budget of {budget_s:.0f} s spent; {len(todo) - i} op timings left to the "
                      "analytic model", file=sys.stderr)
            break
        try:
            if s.key not in profile.compute:
                args, kwargs, _ = _replay_inputs(s, device, grad=False)
                with torch.no_grad():
                    profile.compute[s.key] = time_call(lambda: s.target(*args, **kwargs), device)
                measured += 1
            if backward and _differentiable(s):
                profile.backward[s.key] = _time_backward(s, device, call_s)
        except Exception:  # noqa: BLE001 - an op that cannot replay in isolation keeps its analytic cost
            continue
        if progress and len(todo) > 50 and (i + 1) % 100 == 0:
            print(f"autopar: profiled {i + 1}/{len(todo)} op shapes", file=sys.stderr)
    return measured


def _differentiable(s: OpSample) -> bool:
    return any(m.dtype.is_floating_point for m in s.inputs) and any(m.dtype.is_floating_point for m in s.outputs)


def _replay_inputs(s: OpSample, device: torch.device, grad: bool) -> tuple[Any, Any, list[torch.Tensor]]:
    """The sample's arguments with example tensors in place (floating ones requiring grad
    with `grad`), and those differentiable tensors."""
    tensors = [_example(m, device) for m in s.inputs]
    leaves = [t.requires_grad_() for t in tensors if grad and t.dtype.is_floating_point]
    flat, tree = _compat.tree_flatten((s.args, s.kwargs))
    filled = [tensors[x.index] if isinstance(x, TensorArg) else x for x in flat]
    args, kwargs = _compat.tree_unflatten(filled, tree)
    return args, kwargs, leaves


def _grad_call_s(device: torch.device) -> float:
    """What one torch.autograd.grad call costs around the nodes it runs (starting the
    engine, Python's side of the call), timed on a one-element view: a program's
    backward runs all its nodes in one call, so each op's timing leaves this out."""
    x = torch.zeros(1, device=device, requires_grad=True)
    with torch.enable_grad():
        y = x.view(-1)
    g = torch.ones_like(y)
    return time_call(lambda: torch.autograd.grad(y, x, g, retain_graph=True), device, warmup=5, repeats=21)


def _time_backward(s: OpSample, device: torch.device, call_s: float = 0.0) -> float:
    """Seconds of the op's backward alone: the gradients of its floating inputs from
    random gradients of its floating outputs, through one recorded forward (kept for
    the repeats), less `call_s` (_grad_call_s). Raises where the op records no backward."""
    args, kwargs, leaves = _replay_inputs(s, device, grad=True)
    with torch.enable_grad():
        out = s.target(*args, **kwargs)
    outs = [o for o in _compat.tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        raise ValueError(f"{s.key} records no backward")
    grads = [torch.randn_like(o) for o in outs]
    seconds = time_call(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True), device)
    return max(seconds - call_s, 0.0)


def measure_contention(device: torch.device, group=None) -> float:
    """How much slower a fixed mix of small and large ops runs when every rank of this
    host runs it at once than when rank 0 runs it alone (every rank must call this).
    On a CPU host with more ranks than cores this is the compute term's correction."""
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


def measure_sync_s(device: torch.device, group=None, segments: int = 12, rounds: int = 5) -> float:
    """Seconds a collective costs beyond its own time when ranks reach it from compute,
    as in a program (every rank must call this). Calibration starts each collective on
    ranks that left a barrier together; in a program each rank arrives when its compute
    is done, and where ranks share cores the scheduler hands them the cores unevenly, so
    every collective waits for the rank that got the least. Measured as: segments of
    compute each followed by a small all-reduce, less the same compute without it, less
    the all-reduce alone; the median of `rounds`, averaged over ranks (every rank gets
    the same figure). About 0 where each rank has its own core."""
    a = torch.randn(256, 256, device=device)
    small = torch.zeros(64, device=device)

    def compute():
        x = a
        for _ in range(4):
            x = torch.tanh(x @ a)

    def per_segment(step: Callable[[], Any]) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(segments):
            step()
        dist.barrier(group=group)
        return (time.perf_counter() - t0) / segments

    samples = []
    for _ in range(rounds):
        alone = per_segment(compute)
        collective = per_segment(lambda: dist.all_reduce(small, group=group))
        both = per_segment(lambda: (compute(), dist.all_reduce(small, group=group)))
        samples.append(both - alone - collective)
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return max(0.0, float(t[0]) / dist.get_world_size(group))


# ---- 3. communication calibration ------------------------------------------------

def calibrate(comms: tuple[AxisComm, ...], device: torch.device, sizes: Optional[list[int]] = None, repeats: int = 5,
              kinds: Optional[tuple[LinkKind, ...]] = None) -> dict:
    """Time each collective along each mesh axis on its live group (every rank must call
    this) and fit; `kinds` (Mesh.link_kinds, default all intra-node) tags each fit."""
    sizes = sizes or [4 << 10, 64 << 10, 1 << 20, 4 << 20, 32 << 20]
    kinds = kinds or (LinkKind.INTRA,) * len(comms)
    out = {}
    for axis, comm in enumerate(comms):
        if comm.size == 1:
            continue
        runs = {StepKind.ALL_REDUCE: lambda x: all_reduce(x, comm),
                StepKind.ALL_GATHER: lambda x: all_gather(x, 0, comm),
                StepKind.REDUCE_SCATTER: lambda x: reduce_scatter(x, 0, comm),
                StepKind.ALL_TO_ALL: lambda x: all_to_all(x, 0, 0, comm)}
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
            if kind is StepKind.ALL_GATHER:
                payload = [p * comm.size for p in payload]  # the gathered result's bytes
            out[f"{axis}:{kind.value}"] = {**fit_alpha_beta(payload, t.tolist(), comm.size, kind),
                                           "link": kinds[axis].value}
    return out


# ---- 4. the cached profile of this machine ------------------------------------------

def default_profile_path(device: torch.device) -> str:
    """~/.cache/autopar/profile-<device name>-torch<version>.json"""
    name = f"profile-{_compat.device_name(device)}-torch{torch.__version__}.json".replace(" ", "_")
    return os.path.join(os.path.expanduser("~"), ".cache", "autopar", name)


def save_profile(profile: Profile, path: str) -> None:
    write_json_atomic(path, profile.to_dict())


def profile_for_mesh(path: str, mesh: Mesh, comms: tuple[AxisComm, ...], device: torch.device,
                     nodes: int = 1) -> Profile:
    """The cached profile at `path` (a new one if there is none), with this mesh's links
    calibrated and, on a CPU host, the contention measured, where it lacks them. Every
    rank must call this: calibration runs collectives on every axis. `nodes`
    (Options.nodes) decides each axis's link kind: a fit measured inside one node is not
    reused for an axis that now crosses nodes, nor the other way round."""
    kinds = mesh.link_kinds(nodes)
    if os.path.exists(path):
        profile = Profile.from_dict(read_json(path, "profile", "delete it to measure again"), f"profile {path}")
    else:
        profile = Profile(_compat.device_name(device))
    have = profile.links(mesh.shape, kinds)
    if device.type == "cpu" and (not have or profile.cpu_contention == 1.0 or profile.collective_sync_s is None):
        profile.cpu_contention = measure_contention(device)
        profile.collective_sync_s = measure_sync_s(device)
    if any((a, k) not in have for a, n in enumerate(mesh.shape) if n > 1 for k in COLLECTIVES):
        profile.comm.update(calibrate(comms, device, kinds=kinds))
    return profile
