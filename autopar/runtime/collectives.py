"""Collectives on one mesh axis, with their conjugate backward, started and waited apart.

    step         forward                    backward
    all_reduce   sum (avg: /n, max)         identity (avg: /n; max: where x won)
    all_gather   gather along dim           own slice, or reduce_scatter when fused with f
    reduce_scat. sum, keep own chunk        all_gather
    all_to_all   dim -> to_dim              to_dim -> dim
    slice        own chunk                  all_gather
    to_partial   x on coordinate 0, else 0  identity (the incoming gradient is complete)
    grad_sync    identity                   all_reduce

Every collective is torch's functional collective (`torch.ops._c10d_functional`) on
the tensor forms (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single):
it returns at once with a tensor that `wait_tensor` completes. That is one mechanism
for both ways a program runs: eagerly, where the start and the wait are two nodes of
the program and compute runs between them (passes/lower/schedule.py places them), and
under torch.compile, which traces functional collectives without graph breaks (work
handles would break the graph). A move is a `launch` (lay the input out, issue the
collective) and a `finish` (wait, lay the result out); the two halves of an
asynchronous step are autograd functions whose backward runs the conjugate the same
way round: the wait's backward launches it, the start's backward finishes it, so the
backward work between them overlaps it too.

Uneven shards (torch.chunk blocks, autopar/core/placement.py: only the last block is
short) use the same tensor collectives on blocks padded to the largest, ceil(n / k):

    all_gather      pad my block to ceil(n/k), gather, drop the tail beyond n
    reduce_scatter  pad the whole to k * ceil(n/k), reduce-scatter, trim my block
    all_to_all      pad both dims so, exchange equal pieces, trim both

so every rank moves the same padded bytes (what the cost model prices). A Move carries
the global sizes of its dims (read off the step's layout) and their units (Shard.unit:
blocks of whole heads, ceil(n / (k u)) u, only the last short); an even split skips padding.

Nothing here decides what to run: the Plan's steps do, through runtime/step_runner.py,
which the StepModules of an emitted program (passes/lower/program.py) are bound to.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from autopar.core.kinds import StepKind
from autopar.core.placement import chunk_sizes, largest_block, split_blocks

_C10D = torch.ops._c10d_functional


@dataclass(frozen=True)
class AxisComm:
    """This rank's view of one mesh axis: its process group, size and coordinate."""

    group: Any  # torch.distributed ProcessGroup
    size: int
    coord: int
    name: str  # the group's name, which functional collectives take (and torch.compile traces)
    # no group: each collective is a local stand-in of the right shape (StandInCollectives),
    # so one rank's program runs alone, as the profiler times it (runtime/measure.py)
    stand_in: bool = False

    @staticmethod
    def standing_in(size: int) -> "AxisComm":
        """An axis of `size` ranks seen from coordinate 0, with no process group."""
        return AxisComm(None, size, 0, "", stand_in=True)


@dataclass(frozen=True)
class Move:
    """One collective or local move on an axis, in either direction of a step."""

    kind: StepKind
    dim: Optional[int] = None
    to_dim: Optional[int] = None
    reduce: str = "sum"
    size: Optional[int] = None  # global size of `dim` (None: unknown, taken as even)
    to_size: Optional[int] = None  # global size of `to_dim`
    unit: int = 1  # `dim` is cut between whole groups of `unit` (Shard.unit)
    to_unit: int = 1  # the same for `to_dim`
    complex: bool = False  # complex values travel as their real view (gloo has no complex dtypes)


def _short(size: Optional[int], n: int, unit: int = 1) -> bool:
    """A dim of `size` chunked n ways (in groups of `unit`) has a short last block."""
    return size is not None and (size // unit) % n != 0


def _pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """x grown to `length` along dim with zeros at the end."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


class StandInCollectives:
    """The functional collectives' local stand-ins: a result of the shape the collective
    returns, made without communicating (zeros where it brings other ranks' data, which
    keeps indices valid and values finite), for timing one rank's program alone. Their
    own cost is a copy or a fill of the result, a part of what the collective does."""

    @staticmethod
    def all_reduce(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
        return x.clone()  # the functional all_reduce copies its input too

    @staticmethod
    def all_reduce_(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
        return x

    @staticmethod
    def all_gather_into_tensor(x: torch.Tensor, n: int, name: str) -> torch.Tensor:
        return x.new_zeros((x.shape[0] * n,) + tuple(x.shape[1:]))

    @staticmethod
    def reduce_scatter_tensor(x: torch.Tensor, op: str, n: int, name: str) -> torch.Tensor:
        return x[: x.shape[0] // n].clone()

    @staticmethod
    def all_to_all_single(x: torch.Tensor, output_splits: list, input_splits: list, name: str) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def wait_tensor(x: torch.Tensor) -> torch.Tensor:
        return x


# ---- what must happen before a call's first collective ----------------------------------

_gate = threading.local()  # .settle: what this thread runs before its next collective, or None


@contextlib.contextmanager
def settled_before_first_collective(settle: Optional[Callable[[], None]]) -> Iterator[None]:
    """Inside, settle() runs once, before this thread's first collective (every one goes
    through `_ops` or `before_collective`), or on leaving where none came. A call's input
    agreement (runtime/call_agreement.py) is settled so: started before the program, it
    completes while the program computes up to its first collective, and no collective
    of a program the ranks may not share is launched before it has."""
    before_collective()  # an enclosing call's, still pending, first
    _gate.settle = settle
    try:
        yield
    finally:
        before_collective()


def before_collective() -> None:
    settle = getattr(_gate, "settle", None)
    if settle is not None:
        _gate.settle = None
        settle()


def _ops(comm: AxisComm) -> Any:
    before_collective()
    return StandInCollectives if comm.stand_in else _C10D


# ---- moves: launch (issue) and finish (wait, lay out) ---------------------------------

def launch(move: Move, x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Issue `move` on x; a communicating move returns a tensor `finish` completes, a
    local one its result."""
    n, kind = comm.size, move.kind
    if n == 1 or kind in (StepKind.IDENTITY, StepKind.GRAD_SYNC):
        return x.view_as(x)
    if kind is StepKind.SLICE:
        return split_blocks(x, n, move.dim, move.unit)[comm.coord].contiguous()
    if kind is StepKind.TO_PARTIAL:
        return x.clone() if comm.coord == 0 else torch.zeros_like(x)
    if move.complex:  # a trailing dim of 2 (real, imaginary): every dim the move names stays where it is
        x = torch.view_as_real(x)
    if kind is StepKind.ALL_REDUCE:
        return _ops(comm).all_reduce(x.contiguous(), "max" if move.reduce == "max" else "sum", comm.name)
    if kind is StepKind.ALL_GATHER:
        if _short(move.size, n, move.unit):
            x = _pad(x, move.dim, largest_block(move.size, n, move.unit))
        return _ops(comm).all_gather_into_tensor(x.contiguous(), n, comm.name)
    if kind is StepKind.REDUCE_SCATTER:
        if _short(move.size, n, move.unit):
            x = _pad(x, move.dim, n * largest_block(move.size, n, move.unit))
        return _ops(comm).reduce_scatter_tensor(x.movedim(move.dim, 0).contiguous(), "sum", n, comm.name)
    if kind is StepKind.ALL_TO_ALL:  # send chunk i of to_dim to rank i
        if _short(move.size, n, move.unit):
            x = _pad(x, move.dim, largest_block(move.size, n, move.unit))
        if _short(move.to_size, n, move.to_unit):
            x = _pad(x, move.to_dim, n * largest_block(move.to_size, n, move.to_unit))
        moved = x.movedim(move.to_dim, 0).contiguous()
        splits = [moved.shape[0] // n] * n
        return _ops(comm).all_to_all_single(moved, splits, splits, comm.name)
    raise ValueError(f"unknown move {kind!r}")


def launch_sum_in_place(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Sum contiguous x across the axis into x itself (the functional all_reduce copies its
    input first: a gradient bucket, which nothing else reads or writes until it is
    finished, need not pay that copy); `finish(Move(ALL_REDUCE), ...)` completes it."""
    if comm.size == 1:
        return x
    return _ops(comm).all_reduce_(x, "sum", comm.name)


def finish(move: Move, started: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """The result of a launched move (waits for a collective first)."""
    n, kind = comm.size, move.kind
    if n == 1 or not kind.communicates:
        return started
    y = _ops(comm).wait_tensor(started)
    out = _finished(move, y, n, comm)
    return torch.view_as_complex(out.contiguous()) if move.complex else out


def _finished(move: Move, y: torch.Tensor, n: int, comm: AxisComm) -> torch.Tensor:
    """A waited collective's tensor laid out as the move's result, padding dropped."""
    kind = move.kind
    if kind is StepKind.ALL_REDUCE:
        return y / n if move.reduce == "avg" else y
    out = _laid_out(move, y, n)
    # drop padding: a gathered dim keeps its first `size` (only the last block is short),
    # a scattered one this rank's block
    if kind in (StepKind.ALL_GATHER, StepKind.ALL_TO_ALL) and _short(move.size, n, move.unit):
        out = out.narrow(move.dim, 0, move.size)
    if kind is StepKind.REDUCE_SCATTER and _short(move.size, n, move.unit):
        out = out.narrow(move.dim, 0, chunk_sizes(move.size, n, move.unit)[comm.coord])
    if kind is StepKind.ALL_TO_ALL and _short(move.to_size, n, move.to_unit):
        out = out.narrow(move.to_dim, 0, chunk_sizes(move.to_size, n, move.to_unit)[comm.coord])
    return out


def _laid_out(move: Move, y: torch.Tensor, n: int) -> torch.Tensor:
    """A finished collective's tensor in the layout of the move's result (padded blocks kept)."""
    kind = move.kind
    if kind is StepKind.ALL_GATHER:  # gathered along dim 0: blocks of the input's shape, one per rank
        if move.dim == 0:
            return y
        block = (y.shape[0] // n,) + tuple(y.shape[1:])
        merged = list(block)
        merged[move.dim] *= n
        return y.view(n, *block).movedim(0, move.dim).reshape(merged)
    if kind is StepKind.REDUCE_SCATTER:
        return y if move.dim == 0 else y.movedim(0, move.dim).contiguous()
    if kind is StepKind.ALL_TO_ALL:  # block i came from rank i: its `dim` block of our to_dim chunk
        return torch.cat([b.movedim(0, move.to_dim) for b in y.chunk(n, dim=0)], dim=move.dim)
    raise ValueError(f"unknown move {kind!r}")


def move(m: Move, x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    return finish(m, launch(m, x, comm), comm)


def all_reduce(x: torch.Tensor, comm: AxisComm, reduce: str = "sum") -> torch.Tensor:
    return move(Move(StepKind.ALL_REDUCE, reduce=reduce), x, comm)


def all_gather(x: torch.Tensor, dim: int, comm: AxisComm, size: Optional[int] = None, unit: int = 1
               ) -> torch.Tensor:
    """`size`: the gathered dim's global size, where the blocks may be uneven (cut in
    groups of `unit`)."""
    return move(Move(StepKind.ALL_GATHER, dim, size=size, unit=unit), x, comm)


def reduce_scatter(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    return move(Move(StepKind.REDUCE_SCATTER, dim, size=x.shape[dim]), x, comm)


def all_to_all(x: torch.Tensor, dim: int, to_dim: int, comm: AxisComm, size: Optional[int] = None) -> torch.Tensor:
    """x is split along `dim` (of global `size`, where the blocks may be uneven) across the
    axis; return it split along `to_dim` instead."""
    return move(Move(StepKind.ALL_TO_ALL, dim, to_dim, size=size, to_size=x.shape[to_dim]), x, comm)


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: AxisComm) -> torch.Tensor:
    """Rows in_splits[i] of x go to rank i of the axis; out_splits[i] rows come from it."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    before_collective()
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=comm.group)
    return out


class _RowsAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: AxisComm) -> torch.Tensor:
        ctx.splits, ctx.comm = (out_splits, in_splits), comm
        return exchange_rows(x, out_splits, in_splits, comm)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return exchange_rows(g, in_splits, out_splits, ctx.comm), None, None, None


def rows_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: AxisComm) -> torch.Tensor:
    """exchange_rows as autograd sees it: the backward sends the gradients back the other way."""
    return _RowsAllToAll.apply(x, out_splits, in_splits, comm)
