"""This rank's parameters and buffers: registered empty at compile, cut from the model
when the first plan fixes their layouts.

    model.transformer.h.0.attn.c_attn.weight (768, 2304)
      -> pm.shards.transformer.h.0.attn.c_attn.weight (768, 576)   S(1) on a 4-way axis

1. At compile every parameter exists, empty, under its state-dict name (an optimiser
   can be built before the first call); tied names (one tensor under several names,
   like a shared embedding and LM head) get one shared shard.
2. The first plan gives each tensor a layout (the layout the graph actually reads,
   for tied names); this rank's block is cut from the full tensor, unless the model is
   on the meta device, where a load fills it later.
3. Later plans (new input signatures) keep these layouts: they are pinned.
4. After each call a buffer the program writes (BatchNorm's running statistics, a KV
   cache) takes its new block in place (passes/emit.buffer_blocks, store_buffers).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import nn

from autopar.core.placement import Spec
from autopar.core.plan import Plan
from autopar.passes.lower.emit import shard
from autopar.passes.plan.state_layouts import state_owners, tied_groups, whole_state
from autopar.passes.trace.trace import TracedGraph


def empty_shards(model: nn.Module, device: torch.device,
                 on_grad: Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A module tree mirroring the model's state-dict names, with empty parameters and
    buffers (tied names share one), and the same tensors by dotted name. Each parameter's
    gradient hook calls on_grad(parameter, this backward's gradient) before autograd
    accumulates it (the gradient buckets listen there); the hook holds the parameter
    weakly, so no reference cycle outlives the module."""
    named = whole_state(model)
    root, by_name = nn.Module(), {}
    for group in tied_groups(named, named.__getitem__):
        full = named[group[0]]
        if isinstance(full, nn.Parameter):
            holder: torch.Tensor = nn.Parameter(torch.empty(0, dtype=full.dtype, device=device),
                                                requires_grad=full.requires_grad)
            if full.requires_grad:
                holder.register_hook(_GradHook(holder, on_grad))
        else:
            holder = torch.empty(0, dtype=full.dtype, device=device)
        for name in group:
            _register(root, name, holder)
            by_name[name] = holder
    return root, by_name


class _GradHook:
    def __init__(self, param: torch.Tensor, on_grad: Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]) -> None:
        self.param = weakref.ref(param)
        self.on_grad = on_grad

    def __call__(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        param = self.param()
        if param is not None:
            return self.on_grad(param, grad)  # what autograd accumulates instead of grad, or None
        return None


def fill_shards(model: nn.Module, shards: dict[str, torch.Tensor], traced: TracedGraph, plan: Plan,
                coords: tuple[int, ...], on_meta: bool) -> dict[str, Spec]:
    """Cut this rank's block of every parameter and buffer the graph reads into its
    shard (left empty on meta); returns each state-dict name's Spec."""
    owners = state_owners(traced, plan, shards.__getitem__)
    if not on_meta:
        for owner, spec in dict(owners.values()).items():  # a tied group's tensor once
            full = _full_tensor(model, owner)
            with torch.no_grad():
                shards[owner].data = shard(full.detach(), spec, plan.mesh.shape, coords)
    return {target: spec for target, (_, spec) in owners.items()}


def store_buffers(shards: dict[str, torch.Tensor], blocks: dict[str, torch.Tensor]) -> None:
    """Write each new buffer block (passes/emit.buffer_blocks) into this rank's shard in
    place, as the model's own in-place update would: an optimiser, a state dict or a
    checkpoint taken after the call sees the new values. An eager model that saved a
    buffer for backward and then wrote it would fail the same way here."""
    with torch.no_grad():
        for name, block in blocks.items():
            shards[name].copy_(block)


def _full_tensor(model: nn.Module, name: str) -> torch.Tensor:
    module_path, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(module_path), leaf)


def _register(root: nn.Module, dotted: str, value: torch.Tensor) -> None:
    *path, leaf = dotted.split(".")
    mod = root
    for p in path:
        if not isinstance(getattr(mod, p, None), nn.Module):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)
