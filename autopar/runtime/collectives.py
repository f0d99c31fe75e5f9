"""Collectives on one mesh axis as autograd functions with their conjugate backward,
and the runner that executes the reshard steps of an emitted program.

    step         forward                    backward
    all_reduce   sum (avg: /n, max)         identity (avg: /n; max: where x won)
    all_gather   gather along dim           own slice, or reduce_scatter when fused with f
    reduce_scat. sum, keep own chunk        all_gather
    all_to_all   dim -> to_dim              to_dim -> dim
    slice        own chunk                  all_gather
    to_partial   x on coordinate 0, else 0  identity (the incoming gradient is complete)
    grad_sync    identity                   all_reduce

Nothing here decides what to run: the Plan's steps do; `step_runner` is what the
StepModules of an emitted program (passes/program.py) are bound to. Each call blocks on a
torch.distributed collective whose timeout is the process group's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from autopar import _compat
from autopar.core.errors import CollectiveError
from autopar.core.kinds import StepKind
from autopar.core.resharding import Step
from autopar.passes.program import StepRunner


@dataclass(frozen=True)
class AxisComm:
    """This rank's view of one mesh axis: its process group, size and coordinate."""

    group: Any  # torch.distributed ProcessGroup, or None for a 1-rank axis
    size: int
    coord: int


def _all_reduce(x: torch.Tensor, comm: AxisComm, reduce: str = "sum") -> torch.Tensor:
    y = x.contiguous().clone()
    if comm.size > 1:
        op = dist.ReduceOp.MAX if reduce == "max" else dist.ReduceOp.SUM
        dist.all_reduce(y, op=op, group=comm.group)
        if reduce == "avg":
            y = y / comm.size
    return y


def _all_gather(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(comm.size)]
    dist.all_gather(parts, x, group=comm.group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // comm.size,) + tuple(moved.shape[1:]))
    _compat.reduce_scatter_tensor(out, moved, comm.group)
    return out.movedim(0, dim).contiguous()


def _all_to_all(x: torch.Tensor, dim: int, to_dim: int, comm: AxisComm) -> torch.Tensor:
    """x is split along `dim` across the axis; return it split along `to_dim` instead."""
    if comm.size == 1:
        return x
    send = [c.contiguous() for c in x.chunk(comm.size, dim=to_dim)]
    recv = [torch.empty_like(send[0]) for _ in range(comm.size)]
    dist.all_to_all(recv, send, group=comm.group)
    return torch.cat(recv, dim=dim)


def _slice(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    return x.chunk(comm.size, dim=dim)[comm.coord].contiguous()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, reduce):
        y = _all_reduce(x, comm, reduce)
        ctx.comm, ctx.reduce = comm, reduce
        if reduce == "max":
            ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce == "avg":
            return g / ctx.comm.size, None, None
        if ctx.reduce == "max":
            x, y = ctx.saved_tensors
            return g * (x == y).to(g.dtype), None, None
        return g, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, fused_sync):
        ctx.dim, ctx.comm, ctx.fused_sync = dim, comm, fused_sync
        return _all_gather(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        if ctx.fused_sync:
            return _reduce_scatter(g, ctx.dim, ctx.comm), None, None, None
        return _slice(g, ctx.dim, ctx.comm), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _reduce_scatter(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.comm), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, to_dim, comm):
        ctx.dim, ctx.to_dim, ctx.comm = dim, to_dim, comm
        return _all_to_all(x, dim, to_dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.to_dim, ctx.dim, ctx.comm), None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _slice(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.comm), None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.clone() if comm.coord == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        # the gradient of a partial value is complete and identical on every rank of the
        # axis (it came back through the all-reduce that summed it), so it is x's gradient
        return g, None


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.comm), None


def run_step(step: Step, x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Apply one reshard step to this rank's local tensor."""
    kind = step.kind
    if kind is StepKind.ALL_REDUCE:
        return _AllReduce.apply(x, comm, step.reduce)
    if kind is StepKind.ALL_GATHER:
        return _AllGather.apply(x, step.dim, comm, step.backward is StepKind.REDUCE_SCATTER)
    if kind is StepKind.REDUCE_SCATTER:
        return _ReduceScatter.apply(x, step.dim, comm)
    if kind is StepKind.ALL_TO_ALL:
        return _AllToAll.apply(x, step.dim, step.to_dim, comm)
    if kind is StepKind.SLICE:
        return _Slice.apply(x, step.dim, comm)
    if kind is StepKind.TO_PARTIAL:
        return _ToPartial.apply(x, comm)
    if kind is StepKind.GRAD_SYNC:
        return _GradSync.apply(x, comm)
    raise ValueError(f"unknown reshard step {step.kind!r}")


def step_runner(comms: tuple[AxisComm, ...]) -> StepRunner:
    """What a rank program's StepModules call (passes/program.py: bind): the step on
    this rank's group of its mesh axis; a failure becomes a CollectiveError naming the edge."""
    def run(step: Step, x: torch.Tensor, where: str) -> torch.Tensor:
        comm = comms[step.axis]
        try:
            return run_step(step, x, comm)
        except RuntimeError as e:
            raise CollectiveError(
                f"{step} on the edge {where} failed on mesh coordinate {comm.coord} of axis {step.axis}: {e}. "
                "A peer rank probably failed or stopped first: look at its log (the collective timeout is "
                "Options.collective_timeout_s)") from e
    return run
