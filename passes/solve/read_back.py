"""Stage 4, step 4: the solver's choices read back into a Plan: each node's strategy,
its alternatives priced with its neighbours' choices fixed (what plan.explain shows), the
reshard steps of every edge, and the plan's totals."""

from __future__ import annotations

from typing import Optional, Sequence

from autopar.core.kinds import NodeKind
from autopar.core.plan import Plan
from autopar.core.plan_parts import Alternative, EdgePlan, NodeChoice, RecomputedBlock, SolverReport
from autopar.core.routed import ROUTED_EXPERTS
from autopar.cost_models.evaluate import recompute_terms
from autopar.cost_models.model import CostModel
from autopar.cost_models.hiding import amortised_s
from autopar.cost_models.overlap import plan_hidden_s
from autopar.passes.rules import Strategy
from autopar.passes.solve.ilp import EdgePricer, Member
from autopar.passes.solve.prices import kept_outputs, node_costs
from autopar.passes.strategies.strategies import AnnotatedGraph, PlannedNode
from autopar.passes.trace.experts import routing_notes


def _alternative(n: PlannedNode, alt: Strategy, compute_s: float, chosen: dict[str, Strategy],
                 consumers: dict[str, list[tuple[PlannedNode, int, int]]], pricer: EdgePricer) -> Alternative:
    into = sum(pricer.cost_s(chosen[u].outputs[k], alt, pos) for pos, (u, k) in enumerate(n.inputs))
    out_of = sum(pricer.cost_s(alt.outputs[k], chosen[v.name], pos) for v, pos, k in consumers.get(n.name, ()))
    return Alternative(alt.inputs, alt.outputs, compute_s, into, out_of)


def _alternatives(n: PlannedNode, compute_s: list[float], chosen: dict[str, Strategy],
                  consumers: dict[str, list[tuple[PlannedNode, int, int]]], pricer: EdgePricer,
                  memo: dict[tuple, tuple[Alternative, ...]]) -> tuple[Alternative, ...]:
    """Every strategy of `n` priced with its neighbours' choices fixed; memoised on what
    that reads (the strategy objects, the specs fed in, the consumers' choices), which
    the nodes of repeated layers share."""
    key = (tuple(map(id, n.strategies)), tuple(compute_s),
           tuple(id(chosen[u].outputs[k]) for u, k in n.inputs),
           tuple((id(chosen[v.name]), pos, k) for v, pos, k in consumers.get(n.name, ())))
    found = memo.get(key)
    if found is None:
        found = memo[key] = tuple(_alternative(n, alt, compute_s[i], chosen, consumers, pricer)
                                  for i, alt in enumerate(n.strategies))
    return found


def read_plan(graph: AnnotatedGraph, groups: dict[str, Member], picks: dict[str, int], pricer: EdgePricer,
              costs: CostModel, report: SolverReport, memory: dict[str, list[int]],
              compute: Optional[dict[str, list[float]]] = None, recompute: tuple[RecomputedBlock, ...] = (),
              least: Optional[Sequence[float]] = None, least_fwd: Optional[Sequence[float]] = None,
              in_flight: int = 1, sync_every: int = 1) -> Plan:
    """`compute`: node_costs(graph, costs), when the caller has it; `recompute`: the
    blocks recomputed in backward (their forward again, their inner bytes not kept);
    `least`: in training, the ILP's least backward per node (ilp_overlap.least_backward),
    which the plan's hidden seconds are counted from as the objective counted them;
    `in_flight`: Options.activations_in_flight, which `memory` counts activations with;
    `sync_every`: Options.grad_sync_every, parameter edges paying 1/n of a bucket's
    reduction (cost_models/overlap.py amortised_s)."""
    compute = compute or node_costs(graph, costs)
    chosen = {n.name: n.strategies[groups[n.name].index_map[picks[groups[n.name].leader]]] for n in graph.nodes}
    nodes, edges = [], []
    compute_total = comm_total = 0.0
    param_bytes = act_bytes = state_bytes = 0
    mesh = graph.mesh.shape
    consumers: dict[str, list[tuple[PlannedNode, int, int]]] = {}
    for n in graph.nodes:
        for pos, (u, k) in enumerate(n.inputs):
            consumers.setdefault(u, []).append((n, pos, k))
    kept = kept_outputs(graph, costs)
    kinds = {n.name: n.kind for n in graph.nodes}
    priced_options: dict[tuple, tuple[Alternative, ...]] = {}
    for n in graph.nodes:
        s = chosen[n.name]
        c = compute[n.name][groups[n.name].index_map[picks[groups[n.name].leader]]]
        own_comm = _own_comm_s(n, s, costs)
        compute_total += c - own_comm
        comm_total += own_comm
        options = _alternatives(n, compute[n.name], chosen, consumers, pricer, priced_options)
        nodes.append(NodeChoice(n.name, n.op, s.inputs, s.outputs, c, len(n.strategies), n.module, options,
                                groups[n.name].leader, n.kind, kept.get(n.name, ()),
                                n.call is not None and n.call.causal))
        nbytes = memory[n.name][groups[n.name].index_map[picks[groups[n.name].leader]]]
        if n.kind.is_state or n.kind is NodeKind.CONSTANT:
            param_bytes += s.outputs[0].local_nbytes(mesh)
            state_bytes += nbytes - s.outputs[0].local_nbytes(mesh)
        else:
            act_bytes += nbytes
        for pos, (u, k) in enumerate(n.inputs):
            steps = pricer.steps(chosen[u].outputs[k], s, pos)
            assert steps is not None, f"solver picked an unreachable reshard {u} -> {n.name}"
            comm = costs.steps_cost(steps).total_s - (amortised_s(steps, costs, sync_every)
                                                      if kinds[u] is NodeKind.PARAMETER else 0.0)
            comm_total += comm
            edges.append(EdgePlan(u, k, n.name, pos, steps, comm))
    again = recompute_terms(nodes, edges, recompute, costs)
    hidden = plan_hidden_s(nodes, edges, costs, least, least_fwd or [0.0] * len(nodes), sync_every) \
        if least is not None else 0.0
    return Plan(mesh=graph.mesh, model_name=graph.traced.model_name, fingerprint=graph.traced.fingerprint,
                training=costs.training, device=costs.device.name, nodes=tuple(nodes), edges=tuple(edges),
                compute_s=compute_total + again.compute_s, comm_s=comm_total + again.comm_s, param_bytes=param_bytes,
                activation_bytes=act_bytes + again.memory_bytes * in_flight, solver=report,
                unruled_ops=graph.unruled_ops, state_bytes=state_bytes, discovered_ops=graph.discovered_ops,
                recompute=recompute, hidden_s=hidden, routing_notes=routing_notes(graph.traced.gm),
                grad_sync_every=sync_every)


def _own_comm_s(n: PlannedNode, s: Strategy, costs: CostModel) -> float:
    """An op's own communication (routed experts' all-to-alls, balanced causal attention's
    swaps), which the plan reports as communication."""
    if n.call is None or not (n.call.target is ROUTED_EXPERTS or n.call.causal):
        return 0.0
    return costs.op_cost(n.call.target, s.inputs, s.outputs, n.call.causal).comm_s
