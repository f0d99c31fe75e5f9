"""Bytes a piece of work leaves allocated: what a forward pass keeps for backward.

    loss, kept = kept_bytes(lambda: loss_of(model(x)))   # kept: bytes still held by loss's graph

Every tensor made while `fn` runs is noted by its storage (a TorchDispatchMode sees each
op's outputs); after `fn` returns, the storages still alive are what its result holds:
the activations autograd saved (and, under torch.utils.checkpoint, only the inputs and
outputs of each checkpointed region), plus the result itself. Counting storages, not
tensors, counts a view and its base once. CPU and GPU alike, without a profiler; used to
check the plan's activation bytes (bench/recompute_memory.py, tests/test_recompute.py)."""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autopar import _compat
from autopar.core.kinds import NodeKind
from autopar.core.plan import Plan
from autopar.passes.lower.emit import emit, local_inputs
from autopar.passes.lower.simulate_mesh import run_lockstep
from autopar.passes.trace.trace import TracedGraph, flatten_inputs
from autopar.tools.simulated import loss_of


class _Made(_compat.dispatch_mode()):
    """Notes the storage of every tensor an op returns, unless an op read it first (a
    storage made before: a parameter, and its views such as a transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.older: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in _tensors((args, kwargs)):
            cdata = StorageWeakRef(t.untyped_storage()).cdata
            if cdata not in self.storages:
                self.older.add(cdata)
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata not in self.older:
                self.storages[ref.cdata] = (ref, storage.nbytes())
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in _compat.tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def kept_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn()'s result, and the bytes of the storages made during fn that are still alive."""
    made = _Made()
    with made:
        result = fn()
    gc.collect()
    return result, sum(n for ref, n in made.storages.values() if not ref.expired())


def kept_per_rank(model: torch.nn.Module, args: tuple, kwargs: dict, traced: TracedGraph, plan: Plan) -> float:
    """Per rank: the bytes `plan`'s rank programs (run in lockstep, one training forward
    with parameters as the only leaves that require grad) leave held for backward, with
    the outputs they return."""
    state = {k: v.detach() for k, v in {**dict(model.named_parameters(remove_duplicate=False)),
                                        **dict(model.named_buffers(remove_duplicate=False))}.items()}
    programs = [emit(traced, plan, plan.mesh.coords(r)) for r in range(plan.mesh.size)]
    feeds = [[t.requires_grad_(gi.kind is NodeKind.PARAMETER and t.is_floating_point()) for gi, t in
              zip(p.inputs, local_inputs(p, state, traced.constants, flatten_inputs(args, kwargs)[0],
                                         plan.mesh.shape, state_is_local=False))] for p in programs]
    # the outputs stay referenced beside the loss, as a caller holding `out` through
    # `out.loss.backward()` keeps them (the plan counts what it returns)
    _, kept = kept_bytes(lambda: [(loss_of(out), out) for out in
                                  (_compat.tree_unflatten(traced.user_outputs(o), traced.out_spec)
                                   for o in run_lockstep([p.gm for p in programs], plan.mesh, feeds))])
    return kept / plan.mesh.size
