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

A model of repeated blocks repeats its op calls, so step 2 runs each distinct call once
(_by_signature): an op on fresh fake inputs of the node's shapes, strides, dtypes and
requires-grad flags, with the same other arguments, saves the same of its inputs and
outputs and views the same inputs wherever it stands. Which storage each value has and
whether it requires grad is carried along the graph, so a 32-layer graph runs about one
layer's calls. A call that cannot run alone (an argument this does not model, an op that
fails on fresh inputs) sends the graph to the op-by-op run (_run_in_order).
A graph this cannot run (symbolic sizes, an op without a fake kernel) gets {} and every
output counts, as before. The run leaves any caller's torch.inference_mode, under which
autograd records nothing and every output would read as not kept.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Optional

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
    try:
        return _by_signature(traced)
    except _Unmodelled:
        return _run_in_order(traced)


class _Unmodelled(Exception):
    """A call _by_signature cannot run on its own."""


@dataclass(frozen=True)
class _CallAnswer:
    """What one op call does on fresh inputs: per output, the input position whose storage
    it views (None: storage of its own) and whether it requires grad; the input positions
    and outputs whose storage its backward saves."""
    views: tuple[Optional[int], ...]
    requires_grad: tuple[bool, ...]
    saved_inputs: frozenset[int]
    saved_outputs: frozenset[int]


def _by_signature(traced: TracedGraph) -> dict[str, tuple[bool, ...]]:
    """Step 2 with each distinct call run once (module docstring). Storage is tracked as
    tokens: (node name, output index) for the storage a node made."""
    kinds = {gi.name: gi.kind for gi in traced.inputs}
    token: dict[str, list[Optional[tuple[str, int]]]] = {}  # node -> per output, its storage's maker
    grad: dict[str, list[bool]] = {}
    saved: set[tuple[str, int]] = set()
    answers: dict[Any, _CallAnswer] = {}
    ops: list[str] = []  # the call_function nodes, in graph order
    with torch.inference_mode(False), _compat.fake_mode(), torch.enable_grad():
        for node in traced.gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder":
                tensor = isinstance(val, torch.Tensor)
                token[node.name] = [("<input>", node.name) if tensor else None]
                grad[node.name] = [tensor and kinds.get(node.name) is NodeKind.PARAMETER and val.is_floating_point()]
            elif node.op == "call_function" and node.target is operator.getitem:
                source, index = node.args
                if not isinstance(source, fx.Node) or not isinstance(index, int) or source.name not in token:
                    raise _Unmodelled(node.name)
                token[node.name] = [token[source.name][index]]
                grad[node.name] = [grad[source.name][index]]
                ops.append(node.name)
            elif node.op == "call_function":
                leaves, key = _call_signature(node, token, grad)
                if key not in answers:
                    answers[key] = _run_alone(node, leaves, grad)
                a = answers[key]
                tokens = [token[leaf.name][0] for leaf in leaves]
                outs = [tokens[v] if v is not None else (node.name, i) for i, v in enumerate(a.views)]
                token[node.name], grad[node.name] = outs, list(a.requires_grad)
                ops.append(node.name)
                saved.update(tokens[i] for i in a.saved_inputs)
                saved.update(outs[i] for i in a.saved_outputs)
    return _kept({name: token[name] for name in ops}, saved)


def _kept(made: dict[str, list[Any]], saved: set) -> dict[str, tuple[bool, ...]]:
    """Step 3: per node (in graph order), each output kept when its storage was saved and
    the node is the first to output that storage (a view of a graph input is the first)."""
    first: dict[Any, str] = {}
    for name, storages in made.items():
        for s in storages:
            first.setdefault(s, name)
    return {name: tuple(s is not None and s in saved and first[s] == name for s in storages)
            for name, storages in made.items()}


def _call_signature(node: fx.Node, token: dict, grad: dict) -> tuple[list[fx.Node], Any]:
    """The node's tensor arguments (in flattened order) and a key saying everything the call
    depends on: its op, its other arguments, and each tensor's layout and grad flag."""
    leaves: list[fx.Node] = []

    def leaf(a: fx.Node) -> Any:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor) and a.name in token and len(token[a.name]) == 1:
            leaves.append(a)
            return ("<tensor>", tuple(val.shape), tuple(val.stride()), val.dtype, grad[a.name][0])
        if isinstance(val, (int, float, bool)) and not isinstance(val, torch.SymInt):
            return val
        raise _Unmodelled(node.name)

    flat, spec = _compat.tree_flatten(fx.node.map_arg((node.args, node.kwargs), leaf))
    if any(isinstance(x, (torch.Tensor, torch.SymInt, torch.SymFloat)) for x in flat):
        raise _Unmodelled(node.name)
    same = tuple(leaves.index(a) for a in leaves)  # one node given twice stays one tensor
    return leaves, (node.target, repr(spec), repr(flat), same)


def _run_alone(node: fx.Node, leaves: list[fx.Node], grad: dict) -> _CallAnswer:
    """The node's op on fresh fake tensors of its arguments' layouts, under the saved-tensor hooks."""
    fakes = {leaf.name: _fake_like(leaf.meta["val"], grad[leaf.name][0]) for leaf in leaves}
    order = [_storage(fakes[leaf.name]) for leaf in leaves]
    stored: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        stored.add(_storage(t))
        return t

    args, kwargs = fx.node.map_arg((node.args, node.kwargs),
                                   lambda a: fakes[a.name] if a.name in fakes else a.meta.get("val"))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outputs = _outputs(node.target(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - any failure here sends the graph to the in-order run
        raise _Unmodelled(node.name) from e
    storages = [_storage(t) if isinstance(t, torch.Tensor) else None for t in outputs]
    return _CallAnswer(
        views=tuple(order.index(s) if s in order else None for s in storages),
        requires_grad=tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in outputs),
        saved_inputs=frozenset(i for i, s in enumerate(order) if s in stored),
        saved_outputs=frozenset(i for i, s in enumerate(storages) if s is not None and s in stored
                                and s not in order))


def _run_in_order(traced: TracedGraph) -> dict[str, tuple[bool, ...]]:
    kinds = {gi.name: gi.kind for gi in traced.inputs}
    saved: set[int] = set()
    made: dict[str, list[Optional[int]]] = {}  # node -> storage of each tensor output (None: not a tensor)
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
                made[node.name] = [_storage(t) if isinstance(t, torch.Tensor) else None
                                   for t in _outputs(env[node])]
    return _kept(made, saved)


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
