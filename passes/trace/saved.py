"""Which op outputs autograd keeps for backward, found by running the traced graph once
on fake tensors with saved-tensor hooks.

    TracedGraph -> {node name: (kept?, ...) per output}

The memory model (cost_models/memory.py) counts an op's outputs as the activations a
training step keeps. Autograd keeps fewer: an add feeding a norm is kept (the norm saves
its input), the q projection feeding a rotary multiply by a constant is not (the
multiply saves only the constant), x ** 2 feeding a mean is not. Counting every output
overstates the bytes by ~1.5x on transformer layers (bench/recompute_memory.py), which
is what decides recompute and sharding under a budget.

1. Feed every placeholder a fake tensor of its meta["val"] (parameters requiring grad).
2. Run the graph's ops in order under torch.autograd.graph.saved_tensors_hooks: each
   tensor an op's backward saves is noted by its storage (a view saved keeps its base).
3. A node's output is kept when its storage was saved (the node that made the storage:
   views make none and cost no bytes).
Sharding does not change what is saved, only its size, so one run serves every strategy.
A graph this cannot run (symbolic sizes, an op without a fake kernel) gets {} and every
output counts, as before. The run leaves any caller's torch.inference_mode, under which
autograd records nothing and every output would read as not kept.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from autopar import _compat
from autopar.core.kinds import NodeKind
from autopar.passes.trace.trace import TracedGraph


# the answer per traced graph, kept for its next solve (and gone with the graph)
_ANSWERS: "weakref.WeakKeyDictionary[fx.GraphModule, dict[str, tuple[bool, ...]]]" = weakref.WeakKeyDictionary()


def saved_outputs(traced: TracedGraph) -> dict[str, tuple[bool, ...]]:
    """Per op node, whether each output is kept for backward (module docstring)."""
    if traced.gm not in _ANSWERS:
        try:
            _ANSWERS[traced.gm] = _run(traced)
        except Exception:  # noqa: BLE001 - a graph the fake run cannot take keeps the upper bound
            _ANSWERS[traced.gm] = {}
    return _ANSWERS[traced.gm]


def _run(traced: TracedGraph) -> dict[str, tuple[bool, ...]]:
    kinds = {gi.name: gi.kind for gi in traced.inputs}
    saved: set[int] = set()
    made: dict[str, list[int]] = {}  # node -> storage of each tensor output
    env: dict[fx.Node, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(_storage(t))
        return t

    with torch.inference_mode(False), _compat.fake_mode(), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # 1. fake inputs
        for node in traced.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = _fake_like(node.meta.get("val"), kinds.get(node.name) is NodeKind.PARAMETER)
        # 2. the ops in order
        for node in traced.gm.graph.nodes:
            if node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
                env[node] = node.target(*args, **kwargs)
                made[node.name] = [_storage(t) if isinstance(t, torch.Tensor) else -1
                                   for t in _outputs(env[node])]
    # 3. kept where saved; views share their base's storage and are counted there
    first: dict[int, str] = {}
    for name, storages in made.items():
        for s in storages:
            first.setdefault(s, name)
    return {name: tuple(s in saved and first[s] == name for s in storages) for name, storages in made.items()}


def _fake_like(val: Any, requires_grad: bool) -> Any:
    if not isinstance(val, torch.Tensor):
        return val
    if any(not isinstance(d, int) for d in val.shape):
        raise ValueError("symbolic sizes")
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)
    return t.requires_grad_(requires_grad and t.is_floating_point())


def _outputs(value: Any) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _storage(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata
