"""Data-parallel gradient all-reduce in buckets, overlapped with backward (as DDP does).

The rewrite leaves out grad_sync steps that sit directly on a parameter whose every use
syncs over the same mesh axes (passes/lower/rewrite.py: deferred_grad_syncs); this reduces
their gradients instead.

1. At build time the parameters are laid into buckets of at most GRADIENT_BUCKET_BYTES (core/options.py), per set
   of sync axes, in reverse order of the program's inputs: the order backward produces
   their gradients.
2. During backward each parameter's gradient hook adds this backward's gradient (not
   what .grad held before) into its slot of its bucket's flat buffer; where .grad holds
   an earlier gradient, it hands autograd zeros to accumulate in its place (where .grad is
   None, autograd stores this gradient there, and step 3 overwrites it). Under
   Options.grad_sync_every = n (a pipeline stage: its microbatches) the slot sums the
   gradients of n backwards and only the n-th reduces: DDP's no_sync for the first n - 1.
   In the reducing backward, the moment a bucket is full its all-reduce starts over the
   first axis, in place (the flat buffer is the bucket's own, and no hook writes it again
   before `finish`), while backward goes on.
3. One callback at the end of backward counts it; at the n-th it waits for every bucket,
   reduces over any further axes, empties the bucket for the next backward (a pipeline
   runs several backwards between two forwards' arming), and writes each gradient:
   .grad = reduced, or, where .grad held an earlier (already reduced) gradient when
   this reduction's first backward began, .grad += reduced. Every replica adds the same two numbers, so
   replicas stay bit-equal under gradient accumulation (adding this rank's own part and
   then `reduced - own` rounded differently on each rank), and nothing is copied before
   a forward.
Every rank runs the same program, so buckets fill, start and finish in the same order
on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from autopar import _compat
from autopar.core.errors import GradientError
from autopar.core.options import GRADIENT_BUCKET_BYTES
from autopar.runtime.collectives import AxisComm, Move, all_reduce, finish, launch_sum_in_place
from autopar.core.kinds import StepKind

_SUM = Move(StepKind.ALL_REDUCE)


@dataclass
class _Bucket:
    axes: tuple[int, ...]
    params: list[torch.Tensor] = field(default_factory=list)  # in the order their gradients arrive
    offsets: dict[int, int] = field(default_factory=dict)  # id(param) -> its place in `flat`
    numel: int = 0
    # this reduction's gradients side by side, summed in place; kept from step to step (as
    # DDP keeps its buckets): a fresh 25 MiB buffer each backward cost its allocation and
    # the page faults of first touching it, about a fifth of a (8,1) step on 8 CPU ranks
    flat: Optional[torch.Tensor] = None
    # this backward's: id(param) -> the version of the .grad holding an earlier gradient
    # (None: .grad was None)
    arrived: dict[int, Optional[int]] = field(default_factory=dict)
    # this reduction's (n backwards under grad_sync_every = n): id(param) -> whether .grad
    # held an earlier, reduced gradient when its first gradient arrived (write adds to it)
    summed: dict[int, bool] = field(default_factory=dict)
    started: Optional[torch.Tensor] = None  # the all-reduce in flight


class GradBuckets:
    def __init__(self, params: list[tuple[str, torch.nn.Parameter, tuple[int, ...]]],
                 comms: tuple[AxisComm, ...], reduce_dtype: Optional[torch.dtype] = None, every: int = 1) -> None:
        self.comms = comms
        self.reduce_dtype = reduce_dtype  # the dtype buckets are reduced in (Options.reduce_dtype)
        self.every = every  # backwards per reduction (Options.grad_sync_every)
        self.passes = 0  # backwards finished since the last reduction
        self.reductions = 0  # reductions run (each every `every` backwards)
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, _Bucket] = {}  # id(param) -> its bucket (tied names are one tensor)
        self._layout([(p, axes) for _, p, axes in reversed(params)])
        self.queued = False

    def _layout(self, params: list[tuple[torch.nn.Parameter, tuple[int, ...]]]) -> None:
        """Step 1."""
        open_by_axes: dict[tuple[int, ...], _Bucket] = {}
        for p, axes in params:
            if id(p) in self.bucket_of:
                continue
            bucket = open_by_axes.get(axes)
            if bucket is None or (bucket.numel + p.numel()) * p.element_size() > GRADIENT_BUCKET_BYTES:
                bucket = open_by_axes[axes] = _Bucket(axes)
                self.buckets.append(bucket)
            bucket.params.append(p)
            bucket.offsets[id(p)] = bucket.numel
            bucket.numel += p.numel()
            self.bucket_of[id(p)] = bucket

    def arm(self) -> None:
        """Called before each forward that will be differentiated."""
        for b in self.buckets:
            b.arrived.clear()
            b.started = None
        self.queued = False

    def restart(self) -> None:
        """Forget gradients summed towards a reduction that never came (a step that
        raised part-way): the next backward is the first of n again."""
        self.passes = 0
        for b in self.buckets:
            b.summed.clear()
            b.arrived.clear()
            b.started = None
        self.queued = False

    def gradient(self, param: torch.Tensor, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Step 2: the parameter's gradient hook (before autograd accumulates `grad`); returns
        what autograd accumulates instead (zeros onto an earlier gradient: `finish` adds the
        reduced one), or None to keep `grad`."""
        bucket = self.bucket_of.get(id(param))
        if bucket is None:
            return None
        if not self.queued:
            self.queued = True
            _compat.queue_backward_callback(self.finish)
        if id(param) in bucket.arrived:
            # a leaf's hook fires once per backward, and `finish` empties the bucket at the
            # end of every backward: a second gradient means a backward inside a backward,
            # whose sum may already be on the wire (reducing again would drop it unwaited)
            raise GradientError(f"a data-parallel parameter of shape {tuple(param.shape)} got a second gradient "
                                "within one backward; autopar reduces each parameter's gradient once per backward "
                                "pass (a reentrant backward through the parallel model is not supported)")
        # summed over several backwards in the gradient's own dtype, cast to the reduce dtype at launch
        dtype = grad.dtype if self.every > 1 else self.reduce_dtype or grad.dtype
        if bucket.flat is None or bucket.flat.dtype != dtype or bucket.flat.device != grad.device:
            bucket.flat = grad.new_empty(bucket.numel, dtype=dtype)
        offset = bucket.offsets[id(param)]
        slot = bucket.flat[offset: offset + grad.numel()]
        if id(param) in bucket.summed:
            slot.add_(grad.reshape(-1))
        else:
            slot.copy_(grad.reshape(-1))
            bucket.summed[id(param)] = param.grad is not None
        bucket.arrived[id(param)] = None if param.grad is None else param.grad._version
        if self.passes == self.every - 1 and len(bucket.arrived) == len(bucket.params):
            bucket.started = self._launch(bucket)
        if param.grad is None:
            return None
        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)

    def _launch(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's all-reduce over its first axis, started (in the reduce dtype)."""
        flat = bucket.flat
        if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
            flat = flat.to(self.reduce_dtype)
        return launch_sum_in_place(flat, self.comms[bucket.axes[0]])

    @torch.no_grad()
    def finish(self) -> None:
        """Step 3: every bucket reduced and written back, in the order they filled (at the
        grad_sync_every-th backward; the others only count). Every rank reduces every
        bucket, also when the gradients cannot be written (then it raises after the last
        one, on every rank alike)."""
        refusal = next(filter(None, (_unaccumulated(p, b.arrived[id(p)]) for b in self.buckets
                                     for p in b.params if id(p) in b.arrived)), None)
        self.passes += 1
        self.queued = False
        if self.passes < self.every and refusal is None:
            for bucket in self.buckets:
                bucket.arrived.clear()
            return
        self.passes = 0
        self.reductions += any(b.summed for b in self.buckets)
        for bucket in self.buckets:
            # some parameter got no gradient this time: its slot holds an older sum, which
            # `_write` skips
            if bucket.summed and bucket.started is None:
                bucket.started = self._launch(bucket)
        for bucket in self.buckets:
            if not bucket.summed:
                continue
            reduced = finish(_SUM, bucket.started, self.comms[bucket.axes[0]])
            for axis in bucket.axes[1:]:
                reduced = all_reduce(reduced, self.comms[axis])
            if refusal is None:
                self._write(bucket, reduced)
            # empty for the next backward, which may come before the next forward (a
            # pipeline runs every microbatch's forward, then their backwards)
            bucket.started = None
            bucket.arrived.clear()
            bucket.summed.clear()
        if refusal is not None:
            raise GradientError(refusal)

    @staticmethod
    def _write(bucket: _Bucket, reduced: torch.Tensor) -> None:
        for p in bucket.params:
            if id(p) not in bucket.summed:
                continue
            offset = bucket.offsets[id(p)]
            part = reduced[offset: offset + p.numel()].view_as(p).to(p.grad.dtype)
            if bucket.summed[id(p)]:  # .grad = the earlier (reduced) gradient + 0, from the hook
                p.grad.add_(part)
            else:
                p.grad.copy_(part)


def _unaccumulated(p: torch.Tensor, earlier: Optional[int]) -> Optional[str]:
    """Why the reduced gradient cannot be written, or None: autograd must have accumulated
    into .grad (a fresh one, or an in-place add of the hook's zeros that moved its
    version). Not so under torch.autograd.grad, which returns gradients without
    accumulating them: its answer for this parameter was this rank's own unreduced
    gradient, or the hook's zeros."""
    if (p.grad is None) if earlier is None else (p.grad._version == earlier):
        return (f"a data-parallel parameter of shape {tuple(p.shape)} got a gradient that autograd did not "
                "accumulate into .grad (torch.autograd.grad?), and what autograd returned for it is not its "
                "gradient: autopar reduces data-parallel gradients into .grad during backward, so call "
                "loss.backward() and read .grad")
    return None
