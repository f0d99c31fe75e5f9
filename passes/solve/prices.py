"""Stage 4, step 1: every node's strategies priced: compute seconds (node_costs) and
bytes per rank (node_memory); passes/solve/solve.py reads them into the ILP and
passes/solve/read_back.py into the plan. Reshards are priced on demand by EdgePricer."""

from __future__ import annotations

from autopar.core.kinds import NodeKind
from autopar.core.options import Options
from autopar.cost_models.memory import node_bytes
from autopar.cost_models.model import CostModel
from autopar.passes.strategies.strategies import OUTPUT, AnnotatedGraph
from autopar.passes.trace.saved import saved_outputs


def node_costs(graph: AnnotatedGraph, costs: CostModel) -> dict[str, list[float]]:
    """Seconds of every node's strategies; an op's own communication (routed experts'
    all-to-alls, balanced causal attention's swaps) counts with its compute. Priced once per (op, strategy list): the nodes of
    repeated layers share their strategy lists (passes/strategies/strategies.py _expanded)."""
    out: dict[str, list[float]] = {}
    priced: dict[tuple, list[float]] = {}
    for n in graph.nodes:
        if n.call is None:
            out[n.name] = [0.0] * len(n.strategies)
            continue
        key = (n.call.target, n.call.causal, tuple(map(id, n.strategies)))
        if key not in priced:
            priced[key] = [costs.op_cost(n.call.target, s.inputs, s.outputs, n.call.causal).total_s
                           for s in n.strategies]
        out[n.name] = list(priced[key])
    return out


def node_memory(graph: AnnotatedGraph, costs: CostModel, options: Options) -> dict[str, list[int]]:
    """Bytes per rank of every node's strategies; in training an op counts the outputs
    autograd keeps for backward (passes/trace/saved.py), the output node what it returns.
    What is made per microbatch (the graph's inputs and its ops' outputs) counts
    Options.activations_in_flight times. Priced once per (kind, op, kept outputs,
    strategy list), as node_costs is."""
    kept = kept_outputs(graph, costs)
    out: dict[str, list[int]] = {}
    priced: dict[tuple, list[int]] = {}
    for n in graph.nodes:
        target, saved = n.call.target if n.call else None, kept.get(n.name, ())
        key = (n.kind, target, saved, tuple(map(id, n.strategies)))
        if key not in priced:
            copies = activation_copies(n.kind, options)
            priced[key] = [node_bytes(n.kind, target, s.outputs, graph.mesh.shape, costs.training,
                                      options.optimizer_state_bytes, saved, s.inputs) * copies for s in n.strategies]
        out[n.name] = list(priced[key])
    return out


def activation_copies(kind: NodeKind, options: Options) -> int:
    """How many times a node's bytes count: a parameter, buffer or constant once, what a
    microbatch makes once per microbatch in flight."""
    return 1 if kind.is_state or kind is NodeKind.CONSTANT else options.activations_in_flight


def kept_outputs(graph: AnnotatedGraph, costs: CostModel) -> dict[str, tuple[bool, ...]]:
    """Training: per op, which outputs backward keeps; for the output node, which inputs
    the caller receives (not a buffer's new value). Nothing in inference."""
    if not costs.training:
        return {}
    output = graph.by_name.get(OUTPUT)
    updated = graph.traced.updated_positions
    returned = {} if output is None else {OUTPUT: tuple(i not in updated for i in range(len(output.inputs)))}
    return {**saved_outputs(graph.traced), **returned}
