"""A reshard step of a rank program run on this rank's process groups: the step's two
directions (the forward move and its conjugate, autopar/core/resharding.py's table) as
autograd functions, and the runner the StepModules of an emitted program
(passes/lower/program.py) are bound to.

With overlap, a communicating step is a start and a wait (passes/lower/schedule.py places
compute between them): the start launches the forward collective, the wait finishes it;
in backward the wait's node launches the conjugate and the start's node finishes it, the
gradient travelling between them in a `Started` box. Without overlap each step runs
whole in its start, the form torch.compile traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from autopar.core.errors import CollectiveError
from autopar.core.kinds import StepKind
from autopar.core.resharding import Step
from autopar.runtime.causal_rows import balanced_attention
from autopar.runtime.collectives import AxisComm, Move, finish, launch, move
from autopar.runtime.experts import expert_parallel, expert_parallel_standing_in

# ---- a step's two directions -------------------------------------------------------------

def _global_size(step: Step, dim: Optional[int]) -> Optional[int]:
    """The global size of a tensor dim the step moves (None where the step does not say)."""
    if dim is None or step.before is None:
        return None
    return step.before.meta.shape[dim]


def _complex(step: Step) -> bool:
    return step.before is not None and step.before.meta.dtype.is_complex


def forward_move(step: Step) -> Move:
    return Move(step.kind, step.dim, step.to_dim, step.reduce, _global_size(step, step.dim),
                _global_size(step, step.to_dim), step.dim_unit, step.unit, _complex(step))


def backward_move(step: Step) -> Move:
    """The conjugate (autopar/core/resharding.py's table); all_reduce's avg and max
    backwards are local and handled by the autograd functions."""
    back, complex_ = step.backward, _complex(step)
    if back is StepKind.ALL_TO_ALL:
        return Move(back, step.to_dim, step.dim, size=_global_size(step, step.to_dim),
                    to_size=_global_size(step, step.dim), unit=step.unit, to_unit=step.from_unit, complex=complex_)
    if back is StepKind.ALL_REDUCE:
        return Move(back, complex=complex_)
    return Move(back, step.dim, size=_global_size(step, step.dim), unit=step.dim_unit, complex=complex_)


def reduces(m: Move) -> bool:
    """Sums gradients across ranks: what Options.reduce_dtype applies to."""
    return m.kind in (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER)


class _Step(torch.autograd.Function):
    """A whole step, forward and backward: what runs under torch.compile and for the
    local steps (slice, to_partial, grad_sync) and P(max) reductions."""

    @staticmethod
    def forward(ctx, x, step, comm, reduce_dtype):
        ctx.step, ctx.comm, ctx.reduce_dtype = step, comm, reduce_dtype
        y = move(forward_move(step), x, comm)
        if step.kind is StepKind.ALL_REDUCE and step.reduce == "max":
            ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        step, comm = ctx.step, ctx.comm
        if step.kind is StepKind.ALL_REDUCE and step.reduce == "max":
            x, y = ctx.saved_tensors
            return g * (x == y).to(g.dtype), None, None, None
        if step.kind is StepKind.ALL_REDUCE and step.reduce == "avg":
            return g / comm.size, None, None, None
        m = backward_move(step)
        if ctx.reduce_dtype is not None and reduces(m):
            return move(m, g.to(ctx.reduce_dtype), comm).to(g.dtype), None, None, None
        return move(m, g, comm), None, None, None


@dataclass
class Started:
    """What a step's start hands its wait: the launched forward collective, and, in
    backward, the conjugate the wait's backward launched for the start's backward."""

    tensor: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None
    grad_dtype: Optional[torch.dtype] = None  # the gradient's own dtype when reduced in another


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step, comm, box, reduce_dtype):
        ctx.step, ctx.comm, ctx.box = step, comm, box
        return launch(forward_move(step), x, comm)

    @staticmethod
    def backward(ctx, _placeholder):
        g, ctx.box.grad = ctx.box.grad, None
        step = ctx.step
        if step.kind is StepKind.ALL_REDUCE:  # identity (avg: scaled by the wait's backward)
            return g, None, None, None, None
        out = finish(backward_move(step), g, ctx.comm)
        if ctx.box.grad_dtype is not None:
            out = out.to(ctx.box.grad_dtype)
        return out, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, started, step, comm, box, reduce_dtype):
        ctx.step, ctx.comm, ctx.box, ctx.reduce_dtype = step, comm, box, reduce_dtype
        ctx.shape, ctx.dtype = started.shape, started.dtype
        return finish(forward_move(step), started, comm)

    @staticmethod
    def backward(ctx, g):
        step, comm = ctx.step, ctx.comm
        if step.kind is StepKind.ALL_REDUCE:
            ctx.box.grad = g / comm.size if step.reduce == "avg" else g
        else:
            m = backward_move(step)
            if ctx.reduce_dtype is not None and reduces(m) and g.dtype != ctx.reduce_dtype:
                ctx.box.grad_dtype, g = g.dtype, g.to(ctx.reduce_dtype)
            ctx.box.grad = launch(m, g, comm)
        # the real gradient travels in the box; autograd gets a free stand-in of the right shape
        return torch.zeros((), dtype=ctx.dtype, device=g.device).expand(ctx.shape), None, None, None, None


# ---- what a rank program's steps are bound to ---------------------------------------------

def _splits(step: Step) -> bool:
    """Steps run as a start and a wait: the collectives whose backward autograd can
    carry through the box (not P(max), whose backward needs the forward result)."""
    return step.kind.communicates and not (step.kind is StepKind.ALL_REDUCE and step.reduce == "max")


class ProcessGroupRunner:
    """Runs reshard steps on this rank's process groups (passes/lower/program.py: StepRunner).
    `overlap=False` runs each step whole in its start (its wait passes it on): the form
    torch.compile traces, leaving the ordering of collectives to the compiler."""

    def __init__(self, comms: tuple[AxisComm, ...], overlap: bool = True,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.comms = comms
        self.overlap = overlap
        self.reduce_dtype = reduce_dtype  # dtype of backward reductions (Options.reduce_dtype)

    def start(self, step: Step, x: torch.Tensor, where: str) -> Any:
        comm = self.comms[step.axis]
        rd = self.reduce_dtype
        if not self.overlap:  # plain enough for torch.compile to trace
            return _Step.apply(x, step, comm, rd)
        with _naming(step, comm, where):
            if _splits(step) and comm.size > 1:
                box = Started()
                box.tensor = _Start.apply(x, step, comm, box, rd)
                return box
            return _Step.apply(x, step, comm, rd)

    def wait(self, step: Step, started: Any, where: str) -> torch.Tensor:
        if not isinstance(started, Started):
            return started
        comm = self.comms[step.axis]
        # the box lets go of the launched tensor: the start's autograd node holds the box,
        # so keeping it would tie a reference cycle through the graph (box -> tensor ->
        # its grad_fn -> ctx -> box) that only Python's cycle collector frees, late
        tensor, started.tensor = started.tensor, None
        with _naming(step, comm, where):
            return _Wait.apply(tensor, step, comm, started, self.reduce_dtype)


    def experts(self, axis: int, ids: torch.Tensor, rows: list, experts: list, row_group: list,
                num_experts: int, body: str, where: str) -> torch.Tensor:
        comm = self.comms[axis]
        if comm.stand_in:
            return expert_parallel_standing_in(comm, ids, rows, experts, row_group, body)
        try:
            return expert_parallel(comm, ids, rows, experts, row_group, body)
        except RuntimeError as e:
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError(
                f"expert parallelism at node {where} failed on mesh coordinate {comm.coord} of axis {axis}: {e}. A "
                "peer rank probably failed or stopped first: look at its log") from e

    def causal_rows(self, axis: int, unit: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    dropout_p: float, scale: Optional[float], enable_gqa: bool, where: str) -> torch.Tensor:
        comm = self.comms[axis]
        try:
            return balanced_attention(comm, query, key, value, unit, dropout_p, scale, enable_gqa)
        except RuntimeError as e:
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError(
                f"balanced causal attention at node {where} failed on mesh coordinate {comm.coord} of axis {axis}: "
                f"{e}. A peer rank probably failed or stopped first: look at its log") from e


class _naming:
    """Turns a failing collective into a CollectiveError that names the edge."""

    def __init__(self, step: Step, comm: AxisComm, where: str) -> None:
        self.step, self.comm, self.where = step, comm, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if isinstance(error, RuntimeError) and not isinstance(error, CollectiveError):
            raise CollectiveError(
                f"{self.step} on the edge {self.where} failed on mesh coordinate {self.comm.coord} of axis "
                f"{self.step.axis}: {error}. A peer rank probably failed or stopped first: look at its log (the "
                "collective timeout is Options.collective_timeout_s)") from error
        return False


def step_runner(comms: tuple[AxisComm, ...], overlap: bool = True,
                reduce_dtype: Optional[torch.dtype] = None) -> ProcessGroupRunner:
    return ProcessGroupRunner(comms, overlap, reduce_dtype)
