"""Stage 2: candidate strategies for every node of the traced graph.

    TracedGraph + Mesh -> AnnotatedGraph(nodes: PlannedNode(inputs, strategies))

Uneven shards (torch.chunk blocks with a short last one, autopar/core/placement.py) are
offered in graphs without symbolic sizes, for placeholders and for ops with a hand rule
(passes/rules/registry.py expand says where they are exact); a discovered rule was
verified on even blocks only. Dims that some view splits into heads (head_units) may
also be split in whole heads, S(d/u), where the heads do not divide the axis.

1. Placeholders (parameters, buffers, user inputs) may take any R/S(d) layout; a
   pinned layout (a parameter already sharded by an earlier plan, or a hand plan's
   parameter or input layout) is the only choice.
2. Ops ask their rule in passes/rules for per-axis rules, expanded over the mesh.
   An op pinned by OpOutput (a hand plan's attention layout) keeps only the strategies
   whose first output has the pinned layout.
   An op without a hand-written rule gets the rules passes/strategies/discovery.py verifies by
   experiment; if none hold (or discovery is off) it runs replicated, and one warning
   lists all such ops.
3. getitem of a multi-output op takes the layout of that output.
4. The output node needs every returned tensor replicated (full on every rank).
Nodes that neither take nor make tensors (shape asserts) are not planned.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Optional

import torch
from torch import fx

from autopar import _compat
from autopar.core.errors import PinError, describe_node
from autopar.core.kinds import NodeKind
from autopar.core.log import logged
from autopar.core.mesh import Mesh
from autopar.core.placement import Placement, R, Shard, Spec, TensorMeta, canonical, size_hint
from autopar.passes.strategies.discovery import discover
from autopar.passes.rules import OpCall, Strategy, TensorArg, expand, replicate_rule, rule_for
from autopar.passes.rules.views import group_units, view, view_groups
from autopar.passes.trace.trace import TracedGraph

OUTPUT = "output"


class MissingRuleWarning(UserWarning):
    """Some ops had no sharding rule and were replicated."""


@dataclass(frozen=True)
class OpOutput:
    """A key of `pinned` naming an op node of the traced graph (placeholders are keyed by
    their state-dict key or input index): its first output takes the pinned layout
    (None on a mesh axis: any placement there)."""

    node: str


@dataclass(frozen=True)
class OpInput:
    """A key of `pinned`: the op node `node` reads its tensor input `position` in the
    pinned layout (None on a mesh axis: any placement there)."""

    node: str
    position: int


@dataclass(frozen=True)
class PlannedNode:
    name: str
    op: str  # the ATen overload name, or "placeholder" / "getitem" / "output"
    inputs: tuple[tuple[str, int], ...]  # (producer node, output index) per tensor input
    strategies: tuple[Strategy, ...]
    call: Optional[OpCall] = None
    module: str = ""  # innermost nn.Module path the op came from ("" at top level)
    rule_source: str = "hand"  # "hand", "discovered" or "replicated" (ops); "" for other nodes
    kind: NodeKind = NodeKind.OP


@dataclass(frozen=True)
class AnnotatedGraph:
    traced: TracedGraph
    mesh: Mesh
    nodes: tuple[PlannedNode, ...]  # topological order
    unruled_ops: tuple[str, ...] = ()
    discovered_ops: tuple[str, ...] = ()
    by_name: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def node(self, name: str) -> PlannedNode:
        return self.by_name[name]


def output_metas(node: fx.Node) -> tuple[TensorMeta, ...]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (TensorMeta.of(val),)
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return tuple(TensorMeta.of(v) for v in val)
    return ()


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    leaves, _ = _compat.tree_flatten((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def op_call(node: fx.Node) -> OpCall:
    ins = tensor_inputs(node)
    index = {id(n): i for i, n in enumerate(ins)}

    def mark(a: Any) -> Any:
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.SymInt):
            return size_hint(a.meta["val"])  # a symbolic size: rules see its hint (passes/trace/dynamic.py)
        return TensorArg(index[id(a)]) if isinstance(a, fx.Node) and id(a) in index else a

    args = _compat.tree_unflatten([mark(x) for x in _compat.tree_flatten(node.args)[0]],
                                  _compat.tree_flatten(node.args)[1])
    kwargs = {k: _compat.tree_unflatten([mark(x) for x in _compat.tree_flatten(v)[0]], _compat.tree_flatten(v)[1])
              for k, v in node.kwargs.items()}
    return OpCall(node.target, tuple(args), kwargs, tuple(TensorMeta.of(n.meta["val"]) for n in ins),
                  output_metas(node))


Units = dict  # dim size -> head sizes it is split into somewhere in the graph (head_units)


def layouts(meta: TensorMeta, mesh: Mesh, uneven: bool = False, units: Optional[Units] = None) -> list[Spec]:
    """Every R/S(d) layout of a tensor that divides evenly on the mesh (with `uneven`,
    also those one axis cuts into unequal chunks, and S(d/u) in whole heads of u where a
    dim's heads do not divide the axis; autopar/core/placement.py)."""
    split: list[Placement] = [R] + [Shard(d) for d, s in enumerate(meta.shape) if s > 1]
    per_axis = [split + _head_splits(meta, n, units or {}) if n > 1 else [R] for n in mesh.shape]
    specs = dict.fromkeys(Spec(canonical(tuple(c), meta.shape, mesh.shape), meta) for c in product(*per_axis))
    return [s for s in specs if s.fits(mesh.shape, uneven)]


def _head_splits(meta: TensorMeta, k: int, units: Units) -> list[Placement]:
    return [Shard(d, u) for d, s in enumerate(meta.shape) for u in units.get(s, ()) if (s // u) % k != 0]


def head_units(gm: fx.GraphModule) -> Units:
    """Dim size -> the head sizes some view splits it into or merges it from: a view of
    [.., 320] as [.., 5, 64] gives {320: (64,)}. These are the whole-head splits
    (Shard.unit) offered to parameters and ops (passes/rules/registry.py unit_variants)."""
    found: dict[int, set] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or rule_for(node.target) is not view:
            continue
        src, dst = output_metas(node.args[0]), output_metas(node)
        if len(src) != 1 or len(dst) != 1:
            continue
        for g in view_groups(src[0].shape, dst[0].shape):
            ui, uj = group_units(g) or (1, 1)
            for size, u in ((src[0].shape[g.src_dim], ui), (dst[0].shape[g.dst_dim], uj)):
                if u > 1:
                    found.setdefault(size, set()).add(u)
    return {size: tuple(sorted(us)) for size, us in sorted(found.items())}


@logged("strategies", lambda g: f"{len(g.nodes)} nodes, {sum(len(n.strategies) for n in g.nodes)} strategies")
def annotate(traced: TracedGraph, mesh: Mesh, pinned: dict[str, tuple[Placement, ...]] | None = None,
             discover_rules: bool = True) -> AnnotatedGraph:
    pinned = pinned or {}
    discovered: dict[str, None] = {}
    inputs = {gi.name: gi for gi in traced.inputs}
    nodes: list[PlannedNode] = []
    by_name: dict[str, PlannedNode] = {}
    unruled: dict[str, None] = {}
    # a split of a symbolic size is planned even (passes/trace/dynamic.py)
    units = None if traced.symbolic else head_units(traced.gm)
    expanded: dict[tuple, list[Strategy]] = {}  # repeated layers: one expansion, the same Strategy objects
    for node in traced.gm.graph.nodes:
        planned = _plan_node(node, traced, mesh, inputs, pinned, by_name, unruled,
                             discovered if discover_rules else None, units, expanded)
        if planned is not None:
            nodes.append(planned)
            by_name[planned.name] = planned
    if unruled:
        warnings.warn(MissingRuleWarning(
            f"no sharding rule for {', '.join(unruled)} in model {traced.model_name}; these ops run "
            "replicated (their inputs are gathered). Register rules in passes/rules/ to shard them."),
            stacklevel=3)
    return AnnotatedGraph(traced, mesh, tuple(nodes), tuple(unruled), tuple(discovered), by_name)


def _plan_placeholder(gi: Any, mesh: Mesh, pinned: dict, units: Optional[Units]) -> PlannedNode:
    if gi.target in pinned:  # a state-dict key, or a user input's leaf index
        specs = [Spec(tuple(pinned[gi.target]), gi.meta)]
    else:
        specs = layouts(gi.meta, mesh, units is not None, units)
    return PlannedNode(gi.name, "placeholder", (), tuple(Strategy((), (s,)) for s in specs),
                       rule_source="", kind=gi.kind)


def _plan_node(node: fx.Node, traced: TracedGraph, mesh: Mesh, inputs: dict, pinned: dict,
               by_name: dict, unruled: dict, discovered: Optional[dict], units: Optional[Units],
               expanded: dict[tuple, list[Strategy]]) -> Optional[PlannedNode]:
    """`units`: None where uneven splits are off, else head_units of the graph; `expanded`:
    the strategies of each (rules, op, tensor metas) expanded so far."""
    # 1. placeholders
    if node.op == "placeholder":
        return _plan_placeholder(inputs[node.name], mesh, pinned, units)
    # 4. output
    if node.op == "output":
        outs = [a for a in _compat.tree_flatten(node.args)[0] if isinstance(a, fx.Node)
                and isinstance(a.meta.get("val"), torch.Tensor)]
        specs = tuple(Spec((R,) * mesh.ndim, TensorMeta.of(a.meta["val"])) for a in outs)
        return PlannedNode(OUTPUT, "output", tuple((a.name, 0) for a in outs), (Strategy(specs, ()),),
                           rule_source="", kind=NodeKind.OUTPUT)
    if node.op != "call_function":
        return None
    # 3. getitem
    if node.target is operator.getitem:
        parent, k = node.args
        if parent.name not in by_name or not output_metas(node):
            return None
        seen = dict.fromkeys(s.outputs[k] for s in by_name[parent.name].strategies)
        return PlannedNode(node.name, "getitem", ((parent.name, k),), tuple(Strategy((s,), (s,)) for s in seen),
                           module=by_name[parent.name].module, rule_source="", kind=NodeKind.GETITEM)
    # 2. ops
    outs = output_metas(node)
    ins = tensor_inputs(node)
    if not outs:
        return None
    call = op_call(node)
    rule = rule_for(node.target)
    found = discover(call) if rule is None and discovered is not None else None
    if rule is not None:
        source = "hand"
        try:
            axis_rules = rule(call)
        except Exception as e:  # noqa: BLE001 - a broken rule is reported with its node
            raise RuntimeError(f"sharding rule {rule.__name__} failed on {describe_node(node)}: {e}") from e
    elif found is not None and len(found) > 1:  # more than replication held
        source, axis_rules = "discovered", found
        discovered[str(node.target)] = None
    else:
        source, axis_rules = "replicated", replicate_rule(call)
        unruled[str(node.target)] = None
    rule_name = rule.__name__ if rule is not None else f"{source} rules"
    for r in axis_rules:
        if len(r.inputs) != len(call.inputs) or len(r.outputs) != len(call.outputs):
            raise RuntimeError(
                f"sharding rule {rule_name} for {describe_node(node)} gave {len(r.inputs)} input / "
                f"{len(r.outputs)} output placements; the op has {len(call.inputs)} tensor inputs and "
                f"{len(call.outputs)} tensor outputs")
    hand = units is not None and source == "hand"
    strategies = _expanded(expanded, axis_rules, call, mesh.shape, hand, units if hand else None)
    if OpOutput(node.name) in pinned:
        strategies = _pinned_strategies(node, strategies, tuple(pinned[OpOutput(node.name)]))
    for key in [k for k in pinned if isinstance(k, OpInput) and k.node == node.name]:
        strategies = _pinned_strategies(node, strategies, tuple(pinned[key]), key.position)
    return PlannedNode(node.name, str(node.target), tuple((a.name, 0) for a in ins), tuple(strategies), call,
                       module_path(node), source)


def _expanded(memo: dict[tuple, list[Strategy]], axis_rules: list, call: OpCall, mesh_shape: tuple[int, ...],
              uneven: bool, units: Optional[Units]) -> list[Strategy]:
    """expand(...), memoised on everything it reads: the L layers of a model share their
    ops' strategies, and so the per-strategy memos downstream (edge prices, tables)."""
    key = (tuple(axis_rules), call.target, call.inputs, call.outputs, mesh_shape, uneven,
           None if units is None else tuple(sorted(units.items())))
    try:
        found = memo.get(key)
    except TypeError:  # a symbolic size (dynamic shapes) hashes to nothing: expanded afresh
        return expand(axis_rules, call, mesh_shape, uneven, units)
    if found is None:
        found = memo[key] = expand(axis_rules, call, mesh_shape, uneven, units)
    return found


def _pinned_strategies(node: fx.Node, strategies: list[Strategy], layout: tuple[Optional[Placement], ...],
                       position: Optional[int] = None) -> list[Strategy]:
    """The strategies whose first output (or tensor input `position`) has `layout` (None on
    an axis: any placement there)."""
    def spec(s: Strategy) -> Optional[Spec]:
        specs = s.outputs if position is None else s.inputs
        k = 0 if position is None else position
        return specs[k] if k < len(specs) else None

    kept = [s for s in strategies if spec(s) is not None and len(layout) == len(spec(s).placements)
            and all(w is None or w == p for w, p in zip(layout, spec(s).placements))]
    if not kept:
        offered = sorted({"".join(map(str, spec(s).placements)) for s in strategies if spec(s) is not None})
        pinned = "".join("*" if p is None else str(p) for p in layout)
        what = "" if position is None else f"'s input {position}"
        raise PinError(f"{describe_node(node)}{what} was pinned to {pinned}, which its rule does not offer on this "
                       f"mesh; it offers {', '.join(offered)}")
    return kept


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # the tracing wrapper holds the user's model as attribute `model` (passes/trace/trace.py)
    path = path.removeprefix("L['self'].")
    return "" if path == "model" else path.removeprefix("model.")
