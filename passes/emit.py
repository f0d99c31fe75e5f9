"""Stage 6: the program and the parameter shards of one rank.

    Plan + TracedGraph + rank -> RankProgram(gm, input order, specs)

The program takes its inputs in the traced graph's placeholder order: parameters,
buffers, constants, then the user's tensor leaves, each as this rank's block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from autopar.collectives import AxisComm
from autopar.placement import Spec, local_chunk
from autopar.plan import Plan
from autopar.passes.rewrite import rewrite
from autopar.passes.trace import GraphInput, TracedGraph


@dataclass(frozen=True)
class RankProgram:
    gm: fx.GraphModule
    inputs: tuple[GraphInput, ...]
    specs: tuple[Spec, ...]  # the layout each input is fed in
    coords: tuple[int, ...]

    @property
    def code(self) -> str:
        return self.gm.code


def emit(traced: TracedGraph, plan: Plan, coords: tuple[int, ...],
         comms: Optional[tuple[AxisComm, ...]] = None, device: Optional[torch.device] = None,
         defer_grad_sync: bool = False) -> RankProgram:
    if plan.fingerprint != traced.fingerprint:
        from autopar.errors import UnsupportedModelError
        raise UnsupportedModelError(
            f"plan was made for a different graph (fingerprint {plan.fingerprint}, model {plan.model_name}) than "
            f"the traced {traced.model_name} (fingerprint {traced.fingerprint}); re-plan for this model and inputs")
    comms = comms if comms is not None else tuple(None for _ in plan.mesh.shape)
    gm = rewrite(traced, plan, comms, device, defer_grad_sync, coords)
    specs = tuple(plan.node(gi.name).outputs[0] for gi in traced.inputs)
    return RankProgram(gm, traced.inputs, specs, coords)


def shard(full: torch.Tensor, spec: Spec, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> torch.Tensor:
    """This rank's block of a full tensor, as a fresh contiguous tensor."""
    return local_chunk(full, spec, mesh_shape, coords).contiguous().clone()
