"""What a call hands its caller: the model's outputs in its own structure, each tensor in
the layout the plan returns it in. Whole on every rank (the default) it is a plain
tensor; left split (Options.sharded_outputs, passes/strategies/output_layouts.py) it is
a DTensor on the plan's mesh, whose to_local() is this rank's block and whose
full_tensor() gathers it, with gradients flowing back to the rank program either way."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from autopar import _compat
from autopar.core.errors import MeshError, PlanFileError
from autopar.core.placement import R, Shard
from autopar.core.plan import Plan
from autopar.passes.strategies.strategies import OUTPUT
from autopar.passes.trace.trace import TracedGraph
from autopar.runtime.state import as_dtensor


def caller_outputs(outputs: Sequence[Any], traced: TracedGraph, plan: Plan, device_mesh: Optional[Any]) -> Any:
    """The program's flat `outputs` as the caller receives them: new buffer values left
    out, split tensors as DTensors, in the model's output structure."""
    asked = iter(plan.node(OUTPUT).inputs)  # one spec per tensor output, in order
    updated = traced.updated_positions
    wrapped = []
    for i, value in enumerate(outputs):
        if isinstance(value, torch.Tensor):
            spec = next(asked)
            if i not in updated and not spec.is_replicated():
                if any(p != R and not (isinstance(p, Shard) and p.unit == 1) for p in spec.placements):
                    raise PlanFileError(f"output {i} of {traced.model_name} is returned as {spec}: a DTensor holds "
                                        "whole blocks of even splits only (no partial sums, no S(d/u)); re-plan")
                if device_mesh is None:
                    raise MeshError(f"output {i} of {traced.model_name} comes back split ({spec}) as a DTensor, "
                                    "which needs the mesh's DeviceMesh, and this module has none; plan it without "
                                    "sharded_outputs")
                value = as_dtensor(value, spec, device_mesh)
        wrapped.append(value)
    return _compat.tree_unflatten(traced.user_outputs(wrapped), traced.out_spec)


def is_split(value: Any) -> bool:
    """Whether a returned value is an output left split: a DTensor (known by what it does,
    so that checking needs no import of torch.distributed.tensor)."""
    return callable(getattr(value, "full_tensor", None))
