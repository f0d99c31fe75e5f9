"""Which layout each state tensor of a model takes under a plan, tied names included: what
the runtime cuts shards by (autopar/runtime/shards.py) and what later plans of the same
model must keep (the planner pins them)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from autopar.core.placement import Placement, Spec
from autopar.core.plan import Plan
from autopar.passes.trace.trace import TracedGraph


def tied_groups(names: Iterable[str], tensor_of: Callable[[str], Any]) -> list[list[str]]:
    """Names grouped by the tensor object they hold, in first-seen order."""
    groups: dict[int, list[str]] = {}
    for name in names:
        groups.setdefault(id(tensor_of(name)), []).append(name)
    return list(groups.values())


def whole_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by every state-dict name (tied ones under each)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def state_owners(traced: TracedGraph, plan: Plan, tensor_of: Callable[[str], Any]) -> dict[str, tuple[str, Spec]]:
    """Each state-dict name the graph holds -> (the name whose placeholder decides its
    layout, that Spec). Tied names share one tensor (`tensor_of` tells) and one layout:
    the one of the name the program reads."""
    state_inputs = [gi for gi in traced.inputs if gi.kind.is_state]
    by_target = {gi.target: gi for gi in state_inputs}
    read = {e.producer for e in plan.edges}
    out: dict[str, tuple[str, Spec]] = {}
    for group in tied_groups([gi.target for gi in state_inputs], tensor_of):
        owner = next((by_target[t] for t in group if by_target[t].name in read), by_target[group[0]])
        out.update({target: (owner.target, plan.node(owner.name).outputs[0]) for target in group})
    return out


def pinned_layouts(specs: dict[str, Spec]) -> dict[str, tuple[Placement, ...]]:
    """What later plans must keep: every state tensor's placements."""
    return {name: spec.placements for name, spec in specs.items()}
