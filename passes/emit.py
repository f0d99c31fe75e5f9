"""Stage 6: the program and the parameter shards of one rank.

    Plan + TracedGraph + rank -> RankProgram(gm, input order, specs)

The program takes its inputs in the traced graph's placeholder order: parameters,
buffers, constants, then the user's tensor leaves, each as this rank's block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from autopar.core.errors import FingerprintMismatchError
from autopar.core.placement import Spec, local_chunk
from autopar.core.plan import Plan
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


def emit(traced: TracedGraph, plan: Plan, coords: tuple[int, ...], device: Optional[torch.device] = None,
         defer_grad_sync: bool = False) -> RankProgram:
    """The program of the rank at `coords`; its reshard steps are unbound (passes/program.py)."""
    check_fingerprint(plan, traced, "the plan")
    gm = rewrite(traced, plan, device, defer_grad_sync, coords)
    specs = tuple(plan.node(gi.name).outputs[0] for gi in traced.inputs)
    return RankProgram(gm, traced.inputs, specs, coords)


def shard(full: torch.Tensor, spec: Spec, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> torch.Tensor:
    """This rank's block of a full tensor, as a fresh contiguous tensor."""
    return local_chunk(full, spec, mesh_shape, coords).contiguous().clone()


def check_fingerprint(plan: Plan, traced: TracedGraph, source: str) -> None:
    """A plan runs only on the graph it was made for; `source` names where it came from."""
    if plan.fingerprint != traced.fingerprint:
        raise FingerprintMismatchError(
            f"{source} was made for {plan.model_name} with graph fingerprint {plan.fingerprint}, but "
            f"{traced.model_name} with these inputs traces to {traced.fingerprint}; re-plan for this model and "
            "these input shapes", expected=plan.fingerprint, found=traced.fingerprint)
