"""Per-step metrics of a ParallelModule: wall time, tokens per second per device, model
FLOPs utilisation against the device preset's peak, and peak memory.

A step is one iteration of the user's loop, from one forward (or pm.step) to the next:
forward, backward, the optimizer and data loading, as torchtitan and Megatron time it.
So the metrics of a step are known when the next one starts: `pm.last_step` is None
until the second call.

    tokens       the step's batch x sequence: the elements of its input_ids, else of
                 its largest integer input of two dims (token ids under another name),
                 else its first input's dim 0 (samples); with local inputs, the plan's
                 global size of that input (a dynamic plan's planned size: not the call's)
    model FLOPs  the plan's ops at their global shapes (cost_models/compute.py flops),
                 times three in training (the backward's two matmuls per matmul), scaled
                 by tokens to the step's size where a dynamic plan serves several; what
                 the model computes, not what the ranks run (recompute and replicated
                 work are not counted, as MFU is defined). A call without autograd
                 (inference, generation) counts the forward only
    MFU          model FLOPs / seconds / devices / the peak FLOP/s of the preset the plan
                 was priced with, for the dtype
    memory       the peak so far: CUDA's torch.cuda.max_memory_allocated (not reset, so
                 the user's own readings stand), or the process's resident set (getrusage)

Times are host clocks without a CUDA synchronise: a step's seconds include what the
next step's launch waited for, so single steps jitter while their sum is exact. A
step's own compile (a new input signature's trace and solve) counts in that step.
"""

from __future__ import annotations

import sys
import time

try:
    import resource  # POSIX: a CPU rank's peak resident set
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from autopar.core.plan import Plan
from autopar.cost_models import compute
from autopar.core.errors import OptionsError
from autopar.cost_models.devices import preset
from autopar.cost_models.evaluate import op_target


@dataclass(frozen=True)
class StepMetrics:
    seconds: float
    tokens: int
    tokens_per_s_per_device: float
    model_flops: float
    mfu: float  # of the preset's peak FLOP/s per device
    peak_memory_bytes: int
    memory_kind: str  # "cuda allocated" or "cpu resident (process peak)"

    def __str__(self) -> str:
        return (f"step {self.seconds * 1e3:.1f} ms, {self.tokens_per_s_per_device:,.0f} tokens/s/device, "
                f"MFU {self.mfu * 100:.2f} %, peak memory {self.peak_memory_bytes / 2**20:,.0f} MiB "
                f"({self.memory_kind})")


def combined(steps: Sequence[StepMetrics]) -> StepMetrics:
    """Several steps as one: their seconds, tokens and model FLOPs summed, the rates of
    the sum (a time-weighted mean: tokens/s/device = sum tokens / sum seconds / devices),
    the highest peak memory. A logging window's figures, not the mean of its steps' rates."""
    if not steps:
        raise ValueError("combined() needs at least one step")
    seconds = sum(s.seconds for s in steps)
    return StepMetrics(seconds, sum(s.tokens for s in steps),
                       sum(s.tokens_per_s_per_device * s.seconds for s in steps) / seconds,
                       sum(s.model_flops for s in steps), sum(s.mfu * s.seconds for s in steps) / seconds,
                       max(s.peak_memory_bytes for s in steps), steps[-1].memory_kind)


def token_count(leaves: Sequence[tuple[torch.dtype, tuple[int, ...]]], paths: Sequence[str] = ()) -> int:
    """The tokens (module docstring) of inputs given as (dtype, shape) per tensor leaf,
    with their paths ("kwargs['input_ids']") where known."""
    named = [shape for (dtype, shape), path in zip(leaves, paths) if "'input_ids'" in path]
    if named:
        return int(torch.Size(named[0]).numel())
    ids = [shape for dtype, shape in leaves if not dtype.is_floating_point and not dtype.is_complex
           and dtype is not torch.bool and len(shape) == 2]
    if ids:
        return int(max(torch.Size(shape).numel() for shape in ids))
    return int(leaves[0][1][0]) if leaves and leaves[0][1] else 1


def traced_leaves(traced) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, global shape) of a traced graph's user inputs, in leaf order."""
    user = sorted((gi.target, gi.meta) for gi in traced.inputs if gi.kind == "user_input")
    return [(m.dtype, tuple(m.shape)) for _, m in user]


def plan_flops(plan: Plan, training: bool) -> float:
    """Model FLOPs of one call of the plan's graph at its global shapes."""
    total = 0.0
    for n in plan.nodes:
        if not n.kind.computes:
            continue
        target = op_target(n.op, n.name)
        ins, outs = tuple(s.meta for s in n.inputs), tuple(s.meta for s in n.outputs)
        flops = compute.flops(target, ins, outs)
        total += flops * (1.0 + compute.backward_factor(target, outs)) if training else flops
    return total


class StepMeter:
    """Times the iterations of one module: start() as a forward (or pm.step) is entered,
    begin() once its program is known."""

    def __init__(self, world: int, dtype: torch.dtype, on_cuda: Optional[torch.device]) -> None:
        self.world, self.dtype, self.on_cuda = world, dtype, on_cuda
        self.last: Optional[StepMetrics] = None
        # the running step: its start, tokens, model FLOPs and the device its plan is priced for
        self._open: Optional[tuple[float, int, float, str]] = None
        self._started = 0.0
        # (id of a plan the module keeps, with autograd) -> (model FLOPs, tokens) at its traced size
        self._flops: dict[tuple[int, bool], tuple[float, int]] = {}

    def start(self) -> None:
        """A call is entered: the step before it ends here."""
        self._started = time.perf_counter()
        if self._open is not None:
            start, tokens, flops, device = self._open
            self.last = self._metrics(self._started - start, tokens, flops, device)
            self._open = None

    def begin(self, plan: Plan, traced, tensors: Sequence[torch.Tensor], local: bool, backward: bool) -> None:
        """The step started by start() runs `plan` (traced as `traced`) on these input
        leaves (this rank's blocks where `local`), with autograd where `backward`."""
        paths, key = traced.input_paths, (id(plan), backward)
        if key not in self._flops:  # once per plan: the rest of a call is a look at its inputs
            self._flops[key] = (plan_flops(plan, backward), token_count(traced_leaves(traced), paths))
        flops, planned = self._flops[key]
        tokens = planned if local else token_count([(t.dtype, tuple(t.shape)) for t in tensors], paths)
        self._open = (self._started, tokens, flops * tokens / max(planned, 1), plan.device)

    def _metrics(self, seconds: float, tokens: int, flops: float, device: str) -> StepMetrics:
        seconds = max(seconds, 1e-12)
        return StepMetrics(seconds, tokens, tokens / seconds / self.world, flops,
                           flops / seconds / self.world / peak_flops(device, self.dtype), *peak_memory(self.on_cuda))


def peak_flops(device: str, dtype: torch.dtype) -> float:
    """The peak FLOP/s of the preset a plan was priced with (nan for a profile's device,
    which has no preset)."""
    try:
        spec = preset(device)
    except OptionsError:
        return float("nan")
    return spec.peak_flops.get(dtype, spec.peak_flops[torch.float32])


def peak_memory(on_cuda: Optional[torch.device]) -> tuple[int, str]:
    if on_cuda is not None:
        return int(torch.cuda.max_memory_allocated(on_cuda)), "cuda allocated, peak so far"
    if resource is None:
        return 0, "cpu resident, not read on this platform"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "cpu resident, process peak"


def step_meter(model: torch.nn.Module, options, device: torch.device, world: int) -> StepMeter:
    """The meter of a module running `model` on `device` under `options` (its dtype:
    Options.param_dtype, else the model's first floating parameter's)."""
    dtype = options.param_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return StepMeter(world, dtype, device if device.type == "cuda" else None)
