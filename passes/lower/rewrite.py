"""Stage 5: rewrite the traced graph into the program one rank runs.

    before:  view_7 = view(addmm_1, [2, 8, 32]);  add_4 = add(view_7, dropout)
    after:   all_reduce_0 = self.all_reduce_0(addmm_1)          # P -> R on axis 1
             view_7 = view(all_reduce_0, [2, 8, 32]);  add_4 = add(view_7, dropout)

1. Placeholders stay; they will be fed this rank's shards.
2. Before each planned node, every tensor input goes through the Plan's steps for that
   edge (one StepModule per step, named ap_<kind>_<n>, shared by consumers that need the
   same result; a communicating step is a start and a wait, ap_<kind>_<n>_wait).
3. The node is copied with shape arguments made local (view/reshape/expand sizes), or
   becomes the op's local form (passes/rules/local.py); routed experts split with their
   rows become a module, ap_experts_<node>, that exchanges rows over the axis, and causal
   attention with its rows split on one axis one, ap_causal_<node>, that balances them. In a
   graph with symbolic sizes (passes/trace/dynamic.py) a sym_size read of a dim split k ways
   is multiplied by k (sizes stay global, as the replicated factories need them) and a
   symbolic view/reshape/expand size of a dim split k ways is divided by k:
       sym_size_int_12 = mul(sym_size(input_0, 0), 2);  view(x, [floordiv(sym_size_int_12, 2), ...])
4. Outputs are made replicated, so every rank returns full tensors.
Per-node facts written: node.meta["autopar.spec"] (output placements, e.g. "S(0)R"),
node.meta["autopar.step"] (the Step of a start or wait node).
"""

from __future__ import annotations

import operator
from math import prod
from typing import Any, Optional

import torch
from torch import fx, nn

from autopar import _compat
from autopar.core.errors import PlanFileError
from autopar.core.kinds import NodeKind, StepKind
from autopar.core.placement import Spec
from autopar.core.resharding import Step, with_units
from autopar.core.plan import Plan
from autopar.core.plan_parts import EdgePlan
from autopar.passes.trace.dynamic import is_symbolic
from autopar.core.causal import BalancedCausalRows
from autopar.core.routed import ExpertParallel
from autopar.passes.lower.program import CausalRowsModule, ExpertsModule, StepModule, WaitModule
from autopar.passes.rules.local import LOCAL_TARGET, SIZE_ARG_OPS, localize_call
from autopar.passes.strategies.strategies import OUTPUT
from autopar.passes.trace.trace import TracedGraph

aten = torch.ops.aten

KEEP_META = ("stack_trace", "nn_module_stack", "source_fn_stack")

def rewrite(traced: TracedGraph, plan: Plan, device: Optional[torch.device] = None,
            deferred: Optional[dict[str, tuple[int, ...]]] = None,
            coords: Optional[tuple[int, ...]] = None) -> fx.GraphModule:
    """`device`: where this rank runs; ops that create tensors on the traced device
    (arange(device=...)) create them there instead (a model traced on meta, or rank r on cuda:r).
    `deferred`: the data-parallel gradient syncs of parameters (deferred_grad_syncs) left to
    the runtime's bucketed all-reduce (autopar/runtime/buckets.py) instead of emitted. The steps are
    unbound (passes/lower/program.py): the runtime binds them to its process groups."""
    check_splits(plan)
    edges = {(e.consumer, e.position): e for e in plan.edges}
    choice = {n.name: n for n in plan.nodes}
    mesh_shape = plan.mesh.shape
    root = nn.Module()
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    deferred = deferred or {}
    resharded = _Resharder(root, graph, env, deferred, choice)
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = graph.placeholder(node.name)
            _copy_meta(node, env[node.name], choice)
        elif node.op == "output":
            env[node.name] = graph.output(_map_tensor_args(node.args[0], OUTPUT, env, edges, resharded))
        elif node.op == "call_function":
            args, kwargs = _map_tensor_args((node.args, node.kwargs), node.name, env, edges, resharded)
            target = node.target
            if target is aten.sym_size.int:  # a symbolic size is read whole (passes/trace/dynamic.py)
                env[node.name] = global_size(graph, node, env[node.args[0].name], choice, mesh_shape)
                continue
            if node.name in choice:
                sizes_done = target in SIZE_ARG_OPS and is_symbolic(node.meta.get("val"))
                if sizes_done:
                    sizes = local_sizes(graph, args[1], choice[node.name].outputs[0], mesh_shape)
                    args = (args[0], sizes) + tuple(args[2:])
                target, args, kwargs = localize_call(target, tuple(args), kwargs, choice[node.name].inputs,
                                                     choice[node.name].outputs, mesh_shape, coords, sizes_done)
            if device is not None and isinstance(kwargs.get("device"), torch.device):
                kwargs = {**kwargs, "device": device}
            module = _exchanging_module(target, node.name)
            if module is not None:  # rows exchanged over an axis: a module the runtime binds
                name = f"ap_{'experts' if isinstance(target, ExpertParallel) else 'causal'}_{node.name}"
                root.add_module(name, module)
                new = graph.create_node("call_module", name, tuple(args), dict(kwargs), name=node.name)
            else:
                new = graph.create_node("call_function", LOCAL_TARGET.get(target, target), tuple(args),
                                        dict(kwargs), name=node.name)
            _copy_meta(node, new, choice)
            env[node.name] = new
        else:
            raise NotImplementedError(f"cannot rewrite {node.op} node {node.name}: the traced graph should hold "
                                      "only placeholders, call_function nodes and one output")
    graph.lint()
    return fx.GraphModule(root, graph, class_name="RankProgram")


def _exchanging_module(target: Any, where: str) -> Optional[nn.Module]:
    """The module of a local form that exchanges rows between the ranks of an axis."""
    if isinstance(target, ExpertParallel):
        return ExpertsModule(target.axis, where)
    if isinstance(target, BalancedCausalRows):
        return CausalRowsModule(target.axis, target.unit, where)
    return None


class _Resharder:
    """Step 2: an edge's value after its reshard steps, each step emitted once per
    (producer, steps so far) and shared by every consumer that needs the same result."""

    def __init__(self, root: nn.Module, graph: fx.Graph, env: dict[str, fx.Node],
                 deferred: dict[str, tuple[int, ...]], choice: dict) -> None:
        self.root, self.graph, self.env, self.deferred = root, graph, env, deferred
        self.choice = choice  # node name -> NodeChoice: an edge's target spec (its shards' units)
        self.cache: dict[tuple, fx.Node] = {}

    def __call__(self, edge: EdgePlan) -> fx.Node:
        value = self.env[edge.producer]
        if edge.producer in self.deferred:  # synced after backward, bucketed, by the runtime
            return value
        key: tuple = (edge.producer,)
        consumer = self.choice.get(edge.consumer)
        steps = edge.steps
        if consumer is not None and edge.position < len(consumer.inputs):
            steps = with_units(steps, consumer.inputs[edge.position])
        for step in steps:
            key = key + (step,)
            if key not in self.cache:
                self.cache[key] = self._emit(step, value, f"{edge.producer} -> {edge.consumer}")
            value = self.cache[key]
        return value

    def _emit(self, step: Step, value: fx.Node, where: str) -> fx.Node:
        name = f"ap_{step.kind}_{len(self.cache)}"
        self.root.add_module(name, StepModule(step, where))
        out = self.graph.call_module(name, (value,))
        out.meta["autopar.step"] = step
        if step.kind.communicates:  # a start and a wait, apart (passes/lower/schedule.py)
            self.root.add_module(f"{name}_wait", WaitModule(step, where))
            out = self.graph.call_module(f"{name}_wait", (out,))
            out.meta["autopar.step"] = step
        return out


def check_splits(plan: Plan) -> None:
    """Every split of the plan is one the collectives can serve: even, or torch.chunk
    blocks of one mesh axis with no rank left empty (autopar/core/placement.py). The
    planner makes only such splits; a hand-edited plan file may not, and would otherwise
    run with wrong block sizes."""
    for n in plan.nodes:
        for spec in n.inputs + n.outputs:
            if not spec.fits(plan.mesh.shape, uneven=True):
                raise PlanFileError(
                    f"plan node {n.name} ({n.op}) splits a tensor of shape {spec.meta.shape} as {spec} on mesh "
                    f"{plan.mesh.shape}: a dim that does not divide may be split by one mesh axis only, into "
                    "blocks that leave no rank empty. Re-plan, or edit the plan to split it so")


def deferred_grad_syncs(traced: TracedGraph, plan: Plan) -> dict[str, tuple[int, ...]]:
    """Parameters whose every use is only a grad_sync over the same axes (the data-parallel
    case): their gradient all-reduce moves out of the program to the end of backward, where
    the runtime buckets all of them together (placeholder name -> axes)."""
    params = {gi.name for gi in traced.inputs if gi.kind is NodeKind.PARAMETER}
    axes: dict[str, set] = {}
    for e in plan.edges:
        if e.producer not in params:
            continue
        if not e.steps or any(step.kind is not StepKind.GRAD_SYNC for step in e.steps):
            axes[e.producer] = {None}
            continue
        axes.setdefault(e.producer, set()).add(tuple(step.axis for step in e.steps))
    return {name: next(iter(a)) for name, a in axes.items() if len(a) == 1 and None not in a}


def global_size(graph: fx.Graph, node: fx.Node, local: fx.Node, choice: dict, mesh_shape: tuple[int, ...]) -> fx.Node:
    """sym_size(x, d) of a traced graph with symbolic dims, in the rank program: x is this
    rank's block, so a dim split k ways reads k times its local size. Every size the
    graph computes from it stays global (what arange and the factories, which run
    replicated, need); local_sizes divides where an op needs the block's size."""
    source = node.args[0]
    spec = choice[source.name].outputs[0] if source.name in choice and choice[source.name].outputs else None
    ways = prod(mesh_shape[a] for a in spec.shard_axes(node.args[1])) if spec is not None else 1
    args = (local,) + tuple(node.args[1:])
    if ways == 1:
        return graph.create_node("call_function", node.target, args, {}, name=node.name)
    size = graph.create_node("call_function", node.target, args, {}, name=f"{node.name}_local")
    return graph.create_node("call_function", operator.mul, (size, ways), {}, name=node.name)


def local_sizes(graph: fx.Graph, sizes: Any, output: Spec, mesh_shape: tuple[int, ...]) -> list:
    """A view/reshape/expand size list of a node whose output has symbolic dims, made
    local element by element: a dim split k ways becomes size // k (a graph node where the
    size is one), -1 stays -1 (it is inferred from the local block)."""
    out = []
    for d, size in enumerate(sizes):
        ways = prod(mesh_shape[a] for a in output.shard_axes(d))
        if ways == 1 or (isinstance(size, int) and size == -1):
            out.append(size)
        elif isinstance(size, fx.Node):
            out.append(graph.create_node("call_function", operator.floordiv, (size, ways), {}))
        else:
            out.append(size // ways)
    return out


def _map_tensor_args(tree: Any, consumer: str, env: dict, edges: dict, resharded) -> Any:
    """Replace the i-th tensor input of `consumer` by its resharded value; other graph
    values (non-tensors, unplanned nodes) map to their copies."""
    leaves, spec = _compat.tree_flatten(tree)
    out = []
    position = 0
    for leaf in leaves:
        if isinstance(leaf, fx.Node):
            if isinstance(leaf.meta.get("val"), torch.Tensor) and (consumer, position) in edges:
                out.append(resharded(edges[(consumer, position)]))
            else:
                out.append(env[leaf.name])
            if isinstance(leaf.meta.get("val"), torch.Tensor):
                position += 1
        else:
            out.append(leaf)
    return _compat.tree_unflatten(out, spec)


def _copy_meta(old: fx.Node, new: fx.Node, choice: dict) -> None:
    for k in KEEP_META:
        if k in old.meta:
            new.meta[k] = old.meta[k]
    if old.name in choice and choice[old.name].outputs:
        new.meta["autopar.spec"] = ",".join(str(s) for s in choice[old.name].outputs)
