"""Stage 7: the program and the parameter shards of one rank.

    Plan + TracedGraph + rank -> rewrite (stage 5) -> fold -> recomputed blocks -> schedule (stage 6)
                              -> RankProgram(gm, input order, specs)

The fold (passes/lower/fold.py) drops what need not run every step (export's assertions).
The blocks the plan recomputes become checkpointed
submodules (passes/lower/recompute.py) before the schedule, which then orders the program
and each block's body on its own.

The program takes its inputs in the traced graph's placeholder order: parameters,
buffers, constants, then the user's tensor leaves, each as this rank's block. It
returns the new value of every buffer it writes (TracedGraph.buffer_updates) as the
output node asks it (whole, or the rank's block where the plan keeps an update local),
then the user's outputs; buffer_blocks gives this rank's block of each new value, which
whoever runs the program (runtime or simulator) stores in place of the old one."""

from __future__ import annotations

from dataclasses import dataclass
import logging
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import fx

from autopar.core.errors import FingerprintMismatchError, PlanFileError
from autopar.core.kinds import NodeKind
from autopar.core.log import logged
from autopar.core.options import INFLIGHT_CAP_BYTES
from autopar.core.placement import Spec, local_chunk
from autopar.core.plan import Plan
from autopar.passes.lower.fold import fold
from autopar.passes.lower.recompute import bodies, checkpoint_blocks
from autopar.passes.lower.rewrite import deferred_grad_syncs, rewrite
from autopar.passes.lower.schedule import schedule
from autopar.passes.strategies.strategies import OUTPUT
from autopar.passes.trace.trace import GraphInput, TracedGraph


@dataclass(frozen=True)
class RankProgram:
    gm: fx.GraphModule
    inputs: tuple[GraphInput, ...]
    specs: tuple[Spec, ...]  # the layout each input is fed in
    coords: tuple[int, ...]
    # (parameter input, mesh axes) whose gradient sync the runtime's buckets run after
    # backward instead of the program (passes/lower/rewrite.py deferred_grad_syncs)
    deferred_grad_syncs: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def code(self) -> str:
        return self.gm.code


@logged("emit", lambda p: f"the program of mesh coordinates {p.coords}", logging.DEBUG)
def emit(traced: TracedGraph, plan: Plan, coords: tuple[int, ...], device: Optional[torch.device] = None,
         defer_grad_sync: bool = False, inflight_cap_bytes: Optional[int] = INFLIGHT_CAP_BYTES) -> RankProgram:
    """The program of the rank at `coords`; its reshard steps are unbound (passes/lower/program.py).
    With `inflight_cap_bytes` its collectives are scheduled to overlap compute
    (passes/lower/schedule.py); None keeps each step where the rewrite put it."""
    check_fingerprint(plan, traced, "the plan")
    deferred = deferred_grad_syncs(traced, plan) if defer_grad_sync else {}
    gm = fold(rewrite(traced, plan, device, deferred, coords))
    if plan.recompute:
        checkpoint_blocks(gm, plan)
    if inflight_cap_bytes is not None:
        for program in [gm, *bodies(gm)]:
            schedule(program, plan.mesh.shape, inflight_cap_bytes)
    specs = tuple(plan.node(gi.name).outputs[0] for gi in traced.inputs)
    return RankProgram(gm, traced.inputs, specs, coords, tuple(sorted(deferred.items())))


def full_inputs(inputs: Sequence[GraphInput], state: Mapping[str, torch.Tensor],
                constants: Mapping[str, torch.Tensor], user: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The whole value feeding each graph input, in placeholder order: parameters and
    buffers by state-dict name, lifted constants by name, the user's tensor leaves by index."""
    return [state[gi.target] if gi.kind.is_state else constants[gi.target] if gi.kind is NodeKind.CONSTANT
            else user[gi.target] for gi in inputs]


def local_inputs(program: RankProgram, state: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor],
                 user: Sequence[torch.Tensor], mesh_shape: tuple[int, ...], *, state_is_local: bool,
                 user_is_local: bool = False) -> list[torch.Tensor]:
    """This rank's block of every program input, in placeholder order. `state_is_local`:
    the parameters and buffers given are already this rank's shards (the runtime's);
    `user_is_local`: so are the user's tensors (a loader that reads only this rank's part)."""
    values = full_inputs(program.inputs, state, constants, user)
    out = []
    for gi, spec, x in zip(program.inputs, program.specs, values):
        local = ((gi.kind.is_state and state_is_local)
                 or (gi.kind is NodeKind.USER_INPUT and (user_is_local or spec.is_replicated())))
        out.append(x if local else shard(x, spec, mesh_shape, program.coords))
    return out


def buffer_blocks(program: RankProgram, traced: TracedGraph, plan: Plan, outputs: Sequence[Any],
                  mesh_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """This rank's block of each buffer the program wrote, by state-dict name, under the
    layout the buffer is fed in (its placeholder's spec); no communication either way.
    Where the output node asks the new value in that same layout (a split KV cache kept
    local, passes/plan/buffer_layouts.py) the value returned is the block itself; otherwise
    the plan has gathered (and priced) the new value as the output node asks, and the
    block is cut from it. The runtime and the simulator both store these blocks."""
    asked = plan.node(OUTPUT).inputs
    specs = {gi.name: spec for gi, spec in zip(program.inputs, program.specs)}
    new = traced.updated_buffers(outputs)
    blocks = {}
    for u in traced.buffer_updates:
        value, spec = new[u.target].detach(), specs[u.placeholder]
        kept = asked[u.index].placements == spec.placements
        blocks[u.target] = value if kept else local_chunk(value, spec, mesh_shape, program.coords)
    return blocks


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
    if plan.pipeline is not None:
        return
    planned = {n.name for n in plan.nodes}
    missing = [n.name for n in traced.gm.graph.nodes if n.name not in planned
               and (n.op == "output" or isinstance(n.meta.get("val"), torch.Tensor))]
    if missing:
        raise PlanFileError(f"{source} has no choice for {len(missing)} nodes of {traced.model_name}'s graph "
                            f"(first {missing[:3]}), though its fingerprint matches: it was edited or cut short; "
                            "re-plan, or save the plan again with plan.to_json")
