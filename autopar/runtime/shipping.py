"""One trace for every rank: rank 0 traces, the others rebuild its graph.

    rank 0: export -> serialise (no weights) -> read signature ------.
                                          broadcast (program, fingerprint, inputs) or error
    others: compare own inputs <- receive -'-> load -> read signature -> same fingerprint

A model's Python may build its graph in an order that differs between processes (it
iterates a set, whose order follows PYTHONHASHSEED); every rank tracing for itself
would then get different graphs and no common plan. Tracing once also saves every other
rank the tracing time: the tests' tiny llama (232 nodes) traces in ~0.7 s on a CPU;
serialising takes ~0.3 s on rank 0 and loading ~0.25 s on the others (464 KiB sent).

1. Rank 0 exports (torch.export, functionalisation, differentiable copies), serialises
   the program with torch.export's own serialiser (passes/trace/program_bytes.py:
   faithful to every node and its metadata, versioned with torch; the weights travel
   as meta stand-ins, so a large model sends only its graph), then reads the signature
   of its program (step 4 of passes/trace/trace.py, which renames the placeholders).
2. Rank 0 broadcasts the program, its fingerprint and the signature of its inputs, or
   the error it met, over the default process group (whose timeout bounds the wait).
3. Every other rank compares the signature of its own inputs with rank 0's (a
   difference is a FingerprintMismatchError naming the rank and the input), loads the
   program, reads its signature (step 4 is a pure function of the program) and checks
   that the fingerprint is rank 0's. Where it is not (torch's serialiser wrote some op
   differently), the rank traces the model itself: traces are in canonical form
   (passes/trace/canonical.py), so its own trace is rank 0's graph unless the model's
   Python builds a different graph in each process, which is then the error.
Problems are returned, not raised: planner.agreed_plan raises them on every rank, so
no rank is left waiting in a collective. Where torch's serialiser cannot write rank
0's program at all, every rank traces for itself, and the plan's fingerprint check
still refuses graphs that differ.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from autopar import _compat
from autopar.core.errors import FingerprintMismatchError
from autopar.passes.plan.planning import planning_inputs
from autopar.passes.trace.program_bytes import load_program, program_bytes
from autopar.passes.trace.trace import Leaf, TracedGraph, export_program, flatten_inputs, trace, traced_program
from autopar.runtime.agree import attempt, from_rank, sendable

Traced = tuple[Optional[TracedGraph], Optional[Exception]]


@dataclass(frozen=True)
class Inputs:
    """What every rank's inputs must share with rank 0's: their structure, each tensor
    leaf's path, shape and dtype, and the non-tensor leaves."""

    structure: str
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    constants: tuple[Any, ...]

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "Inputs":
        tensors, spec, consts = flatten_inputs(args, kwargs)
        paths = _compat.tensor_leaf_paths((tuple(args), dict(kwargs)))
        return cls(str(spec), tuple((p, tuple(t.shape), t.dtype) for p, t in zip(paths, tensors)),
                   tuple(_comparable(c) for c in consts if c is not Leaf.TENSOR))


@dataclass(frozen=True)
class Shipment:
    """Rank 0's trace as the other ranks receive it; `program` None: trace for yourself."""

    program: Optional[bytes]
    fingerprint: str
    inputs: Inputs


def shared_trace(model: nn.Module, args: tuple, kwargs: dict, param_dtype: Optional[torch.dtype],
                 device: torch.device, dynamic_shapes: Optional[tuple] = None, group: Any = None) -> Traced:
    """This rank's TracedGraph of `model(*args, **kwargs)`, traced on rank 0 only, or the
    error met (here or on rank 0). `device`: where this rank runs. `dynamic_shapes`:
    torch.export's symbolic dims (passes/trace/dynamic.py), the same on every rank. `group`:
    the ranks sharing the trace (a pipeline stage's sub-mesh; None: the world), its
    first rank tracing."""
    if dist.get_world_size(group) == 1:
        return attempt(lambda: trace(model, *planning_inputs(model, args, kwargs), param_dtype, dynamic_shapes))
    rank = dist.get_rank(group)
    box: list = [None]
    traced, problem = None, None
    if rank == 0:
        out, problem = attempt(lambda: _traced_here(model, args, kwargs, param_dtype, dynamic_shapes))
        traced, box[0] = out if problem is None else (None, sendable(problem))
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    if rank == 0:
        return traced, problem
    if isinstance(box[0], Exception):
        return None, from_rank(box[0], 0)
    return attempt(lambda: _rebuilt(box[0], model, args, kwargs, param_dtype, device, rank, dynamic_shapes))


def _traced_here(model: nn.Module, args: tuple, kwargs: dict, param_dtype: Optional[torch.dtype],
                 dynamic_shapes: Optional[tuple] = None) -> tuple[TracedGraph, Shipment]:
    """Rank 0: its TracedGraph and what it sends (step 1)."""
    args, kwargs = planning_inputs(model, args, kwargs)
    ep = export_program(model, args, kwargs, param_dtype, dynamic_shapes)
    data, problem = attempt(lambda: program_bytes(ep))  # before traced_program renames ep
    if problem is not None:
        warnings.warn(f"autopar: torch's serialiser cannot write the traced program of {type(model).__name__} "
                      f"({type(problem).__name__}: {problem}); every rank traces it for itself", stacklevel=2)
    traced = traced_program(ep, model, args, kwargs)
    return traced, Shipment(data, traced.fingerprint, Inputs.of(args, kwargs))


def _rebuilt(shipment: Shipment, model: nn.Module, args: tuple, kwargs: dict, param_dtype: Optional[torch.dtype],
             device: torch.device, rank: int, dynamic_shapes: Optional[tuple] = None) -> TracedGraph:
    """Another rank: rank 0's graph on this rank's inputs (step 3)."""
    args, kwargs = planning_inputs(model, args, kwargs)
    check_inputs(shipment.inputs, Inputs.of(args, kwargs), rank)
    if shipment.program is None:
        return trace(model, args, kwargs, param_dtype, dynamic_shapes)
    traced = traced_program(load_program(shipment.program, device), model, args, kwargs)
    if traced.fingerprint == shipment.fingerprint:
        return traced
    # torch's serialiser changed the program on its way (an op it writes differently):
    # this rank's own trace, in canonical form, is rank 0's graph for any model whose
    # graph does not depend on the process
    traced = trace(model, args, kwargs, param_dtype, dynamic_shapes)
    if traced.fingerprint != shipment.fingerprint:
        raise FingerprintMismatchError(
            f"rank {rank} traced {traced.model_name} as graph {traced.fingerprint} (and rebuilt rank 0's program "
            f"as another), but rank 0 traced {shipment.fingerprint}: the model builds a different graph in each "
            "process (its Python depends on something besides its inputs, such as a random draw, the time or the "
            "process id); make its forward depend only on its inputs and state",
            expected=shipment.fingerprint, found=traced.fingerprint)
    return traced


def check_inputs(theirs: Inputs, mine: Inputs, rank: int) -> None:
    """Rank 0's inputs and this rank's share their structure, tensor shapes and dtypes and
    non-tensor values; else a FingerprintMismatchError naming the first difference."""
    def mismatch(what: str, ours: Any, rank0: Any) -> FingerprintMismatchError:
        return FingerprintMismatchError(
            f"rank {rank} passes {what} {ours} but rank 0 passes {rank0}; every rank must pass the same model "
            "and input shapes", expected=str(rank0), found=str(ours))
    if mine.structure != theirs.structure or len(mine.tensors) != len(theirs.tensors):
        raise mismatch("inputs structured as", mine.structure, theirs.structure)
    for (path, shape, dtype), (_, shape0, dtype0) in zip(mine.tensors, theirs.tensors):
        if (shape, dtype) != (shape0, dtype0):
            raise mismatch(f"input {path} of shape", f"{list(shape)} {dtype}", f"{list(shape0)} {dtype0}")
    for i, (c, c0) in enumerate(zip(mine.constants, theirs.constants)):
        if repr(c) != repr(c0):  # repr: a nan equals itself
            raise mismatch(f"non-tensor input #{i} =", c, c0)


def _comparable(value: Any) -> Any:
    """A non-tensor input as ranks compare it: plain values as they are, a device by its
    type (rank r runs on cuda:r), anything else by its type's name."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, torch.device):
        return f"device {value.type}"
    return f"a {type(value).__qualname__}"
