"""Measuring on this machine and its live process groups, for the profiling cost model.

1. compute: every distinct (op, local shapes) the candidate strategies would run is
   timed here (CUDA events on a GPU, a monotonic clock on a CPU), forward and, for a
   training plan, backward;
2. the program: a planned rank program run alone, its collectives standing in, against
   the sum of its ops' timings (Profile.program_factor: ops run slower inside a program
   than alone);
3. contention: on a CPU host, how much slower ranks run when they share cores, and what
   each collective costs them in waiting for one another;
4. links: each collective timed along each mesh axis on this rank's own group of that
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
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from autopar import _compat
from autopar.core.files import read_json, write_json_atomic
from autopar.core.kinds import NodeKind, StepKind
from autopar.core.links import LinkKind
from autopar.core.mesh import Mesh
from autopar.core.placement import TensorMeta
from autopar.core.plan import Plan
from autopar.cost_models.profile import COLLECTIVES, Profile, compute_key, fit_alpha_beta, program_key
from autopar.passes.lower.emit import emit, local_inputs
from autopar.passes.lower.program import bind
from autopar.passes.rules.local import localize_call
from autopar.passes.trace.trace import TracedGraph
from autopar.passes.rules import TensorArg
from autopar.passes.strategies.strategies import AnnotatedGraph
from autopar.runtime.collectives import AxisComm, all_gather, all_reduce, all_to_all, reduce_scatter
from autopar.runtime.step_runner import step_runner


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
                target, args, kwargs = localize_call(n.call.target, n.call.args, n.call.kwargs, s.inputs,
                                                     s.outputs, mesh_shape, origin)
                seen[key] = OpSample(key, target, args, kwargs, ins, outs)
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


# ---- 2. a planned program as a whole -----------------------------------------------

def program_alone(traced: TracedGraph, plan: Plan, device: torch.device, state: dict[str, torch.Tensor],
                  user: list[torch.Tensor], training: bool) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """`plan`'s program for mesh coordinate 0 (the largest blocks), runnable on this rank
    alone: its collectives are stand-ins of the right shapes (collectives.StandInCollectives),
    its gradient syncs left out as at run time (the buckets reduce them). Returns the
    program, its inputs (this coordinate's blocks of `state`, the whole model's parameters
    and buffers by state-dict name, and of `user`, the user's tensor leaves) and, in
    training, the parameter blocks among them that require grad."""
    coords = (0,) * len(plan.mesh.shape)
    program = emit(traced, plan, coords, device, defer_grad_sync=True, inflight_cap_bytes=None)
    bind(program.gm, step_runner(tuple(AxisComm.standing_in(n) for n in plan.mesh.shape), overlap=False))
    whole = {k: v.detach() for k, v in state.items()}
    inputs = [t.to(device) for t in local_inputs(program, whole, traced.constants, user, plan.mesh.shape,
                                                 state_is_local=False)]
    if training:
        inputs = [t.detach().requires_grad_() if gi.kind is NodeKind.PARAMETER and t.is_floating_point() else t
                  for gi, t in zip(program.inputs, inputs)]
    return program.gm, inputs, [t for t in inputs if t.requires_grad]


def time_program(traced: TracedGraph, plan: Plan, device: torch.device, state: dict[str, torch.Tensor],
                 user: list[torch.Tensor], training: bool) -> float:
    """Median seconds of one step of program_alone: forward, and in training backward to
    the parameters from the loss (the first scalar output; else every floating output)."""
    gm, inputs, leaves = program_alone(traced, plan, device, state, user, training)

    def step() -> None:
        with torch.set_grad_enabled(bool(leaves)):
            outs = [o for o in _compat.tree_flatten(gm(*inputs))[0] if isinstance(o, torch.Tensor)]
        roots = [o for o in outs if o.requires_grad]
        scalars = [o for o in roots if o.dim() == 0]
        roots = scalars[:1] or roots
        if roots:
            torch.autograd.grad(roots, leaves, [torch.ones_like(r) for r in roots], allow_unused=True)
    return time_call(step, device, warmup=1, repeats=3)


def calibrate_program(traced: TracedGraph, plan: Plan, profile: Profile, device: torch.device,
                      state: dict[str, torch.Tensor], user: list[torch.Tensor], training: bool,
                      budget_s: float = 120.0) -> bool:
    """Profile.program_factor for this graph, mesh and mode where the profile lacks it:
    `plan`'s program timed alone (time_program) over what its ops' timings add up to.
    `plan` must have been priced without a factor. True when it measured one (the caller
    plans again to use it); a program that cannot run alone, or whose four timed steps
    would take over `budget_s` (the other ranks wait), keeps its ops' timings."""
    key = program_key(traced.fingerprint, plan.mesh.shape, training)
    ops_s = plan.compute_s / profile.cpu_contention  # the plan's compute, at the timings' own speed
    if key in profile.program_factor or ops_s <= 0 or 4 * ops_s > budget_s:
        return False
    try:
        measured = time_program(traced, plan, device, state, user, training)
    except Exception as e:  # noqa: BLE001 - the op timings stand, as where an op cannot replay alone
        warnings.warn(f"autopar: the planned program of {traced.model_name} could not be timed alone "
                      f"({type(e).__name__}: {e}); its ops are priced at their own timings")
        return False
    profile.program_factor[key] = measured / ops_s
    return True


# ---- 3. contention -------------------------------------------------------------------

def measure_contention(device: torch.device, group=None, repeats: int = 7, rounds: int = 3) -> float:
    """How much slower a fixed mix of small and large ops runs when every rank of this
    host runs it at once than when rank 0 runs it alone (every rank must call this).
    On a CPU host with more ranks than cores this is the compute term's correction.
    Together is timed as throughput, barrier to barrier, while every rank runs the mix
    `repeats` times (the median of `rounds`): each rank timing its own repeats, as this
    did before, let ranks that finished first hand the cores to the rest, and read
    anywhere from 3.9 to 5.3 for 8 ranks on 2 cores; this reads 4.5-4.7 with rare 5.4."""
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
        alone[0] = time_call(work, device, warmup=2, repeats=2 * repeats + 1)
    dist.broadcast(alone, src=0, group=group)
    samples = []
    for _ in range(rounds):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(repeats):
            work()
        dist.barrier(group=group)
        samples.append((time.perf_counter() - t0) / repeats)
    together = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(together, op=dist.ReduceOp.MAX, group=group)  # every rank the same figure
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


# ---- 4. communication calibration ------------------------------------------------

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


# ---- 5. the cached profile of this machine ------------------------------------------

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
