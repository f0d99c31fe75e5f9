"""Per-step metrics of a ParallelModule: wall time, tokens per second per device, model
FLOPs utilisation against the device preset's peak, and peak memory.

A step is one iteration of the user's loop, from one forward (or pm.step) to the next:
forward, backward, the optimizer and data loading, as torchtitan and Megatron time it.
So the metrics of a step are known when the next one starts: `pm.last_step` is None
until the second call.

    tokens       the step's batch x sequence: the elements of its first integer input
                 of two dims or more (the token ids), else its first input's dim 0
                 (samples); with local inputs, the plan's global size of that input
    model FLOPs  the plan's ops at their global shapes (cost_models/compute.py flops),
                 times three in training (the backward's two matmuls per matmul), scaled
                 by tokens to the step's size where a dynamic plan serves several; what
                 the model computes, not what the ranks run (recompute and replicated
                 work are not counted, as MFU is defined)
    MFU          model FLOPs / seconds / devices / the preset's peak FLOP/s for the dtype
    memory       CUDA: torch.cuda.max_memory_allocated over the step (reset at its
                 start); CPU: the process's peak resident set so far (getrusage)
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from autopar.core.plan import Plan
from autopar.cost_models import compute
from autopar.cost_models.devices import DeviceSpec, preset
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


def token_count(leaves: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """The tokens (module docstring) of inputs given as (dtype, shape) per tensor leaf."""
    for dtype, shape in leaves:
        if not dtype.is_floating_point and not dtype.is_complex and len(shape) >= 2:
            return int(torch.Size(shape).numel())
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
    """Times the iterations of one module (begin() at each forward or pm.step)."""

    def __init__(self, device: DeviceSpec, world: int, dtype: torch.dtype, on_cuda: Optional[torch.device]) -> None:
        self.device, self.world, self.dtype, self.on_cuda = device, world, dtype, on_cuda
        self.last: Optional[StepMetrics] = None
        self._open: Optional[tuple[float, int, float]] = None  # start, tokens, model FLOPs of the running step
        # (id of a plan the module keeps, training) -> (model FLOPs, tokens) at its traced size
        self._flops: dict[tuple[int, bool], tuple[float, int]] = {}

    def begin(self, plan: Plan, traced, tensors: Sequence[torch.Tensor], local: bool, training: bool) -> None:
        """A step of `plan` (traced as `traced`) starts with these input leaves (this
        rank's blocks where `local`); the one before it ends."""
        now = time.perf_counter()
        if self._open is not None:
            self.last = self._metrics(now - self._open[0], self._open[1], self._open[2])
        at_trace = traced_leaves(traced)
        tokens = token_count(at_trace if local else [(t.dtype, tuple(t.shape)) for t in tensors])
        key = (id(plan), training)
        if key not in self._flops:
            self._flops[key] = (plan_flops(plan, training), token_count(at_trace))
        flops, planned = self._flops[key]
        if self.on_cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.on_cuda)
        self._open = (now, tokens, flops * tokens / max(planned, 1))

    def _metrics(self, seconds: float, tokens: int, flops: float) -> StepMetrics:
        peak = self.device.peak_flops.get(self.dtype, self.device.peak_flops[torch.float32])
        if self.on_cuda is not None:
            memory, kind = torch.cuda.max_memory_allocated(self.on_cuda), "cuda allocated"
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
            memory, kind = (rss if sys.platform == "darwin" else rss * 1024), "cpu resident (process peak)"
        seconds = max(seconds, 1e-12)
        return StepMetrics(seconds, tokens, tokens / seconds / self.world, flops,
                           flops / seconds / self.world / peak, int(memory), kind)


def step_meter(model: torch.nn.Module, options, device: torch.device, world: int) -> StepMeter:
    """The meter of a module running `model` on `device` under `options` (its preset:
    what Options.device names or detects; its dtype: Options.param_dtype, else the
    model's first floating parameter's)."""
    spec = preset(options.device) if isinstance(options.device, str) else options.device
    dtype = options.param_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return StepMeter(spec, world, dtype, device if device.type == "cuda" else None)
