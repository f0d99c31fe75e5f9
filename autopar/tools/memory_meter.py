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
