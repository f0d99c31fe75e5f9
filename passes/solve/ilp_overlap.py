"""The overlap term of the ILP (passes/solve/ilp.py states it with the rest of the model): the
shares of compute under which each parameter edge's collectives hide, and on GPU presets each
activation edge's (cost_models/overlap.py), so that the solver minimises the step evaluate()
prices.

    share[e]   for a parameter edge e = (p, v): its bucket's stretch compute C_k (the
               least backward seconds of the stretch's ops, under any strategy: a
               constant of the graph), split over the bucket's parameters by bytes and
               evenly over p's uses; and its prefetch window's least forward and
               backward seconds F, B, split over the parameters used at v by bytes
    R'[e,o,r]  = R[e,o,r] - (1 - 1/n) H[e,o,r] - min(H[e,o,r] / n, share[e])
                 - min(Hf[e,o,r], F[e]) - min(Hb[e,o,r], B[e])
               H: the reduction the bucket carries, n: backwards per reduction
               (Options.grad_sync_every); Hf, Hb: the first step's two directions where
               the schedule prefetches it on a GPU preset
    share[e]   for an activation edge e = (u, v) on a GPU preset: of the least forward and
               backward seconds of the positions between u and v, what the parameter
               windows cannot use, each position's split by bytes among the windows over
               it; R'[e,o,r] = R[e,o,r] - min(Hf, F[e]) - min(Hb, B[e])

R' replaces R on every such edge (inside a group too), so the ILP keeps its rows
and columns: min() of a price and a constant is one more price. Dominance pruning
(passes/solve/dominance.py) reads the same R', and stays exact.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from autopar.core.kinds import NodeKind
from autopar.cost_models.model import CostModel
from autopar.cost_models.hiding import Share
from autopar.cost_models.overlap import activation_terms, edge_share_table, global_nbytes, parameter_uses
from autopar.passes.strategies.strategies import AnnotatedGraph


def least_backward(graph: AnnotatedGraph, compute_s: Mapping[str, Sequence[float]],
                   forward_s: Mapping[str, Sequence[float]]) -> list[float]:
    """Per node in graph order, the least backward seconds of its strategies; `compute_s`
    and `forward_s` are solve.node_costs under the training and the forward-only cost
    model (their difference is each strategy's backward)."""
    return [min((c - f for c, f in zip(compute_s[n.name], forward_s[n.name])), default=0.0)
            if n.call is not None else 0.0 for n in graph.nodes]


def least_forward(graph: AnnotatedGraph, forward_s: Mapping[str, Sequence[float]]) -> list[float]:
    """Per node in graph order, the least forward seconds of its strategies."""
    return [min(forward_s[n.name], default=0.0) if n.call is not None else 0.0 for n in graph.nodes]


def graph_shares(graph: AnnotatedGraph, least: Sequence[float], least_fwd: Sequence[float],
                 sync_every: int = 1, costs: Optional[CostModel] = None) -> dict[tuple[str, int], Share]:
    """(consumer, position) -> share[e] for every parameter edge of a training graph, and
    where `costs` runs collectives beside compute (a GPU preset) every activation edge
    with a window (cost_models/overlap.py); `least`, `least_fwd`: least_backward and
    least_forward of its nodes; `sync_every`: Options.grad_sync_every (each backward pays
    1/n of a bucket's reduction)."""
    params = [(n.name, global_nbytes(n.strategies[0].outputs[0].meta)) for n in graph.nodes
              if n.kind is NodeKind.PARAMETER and n.strategies]
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    edges = [(u, v.name, pos) for v in graph.nodes for pos, (u, _) in enumerate(v.inputs)]
    windows, bounds = [], {}
    if costs is not None:
        by_name = {n.name: n for n in graph.nodes}
        windows, bounds = activation_terms(
            [(n.name, n.kind if n.strategies else None) for n in graph.nodes],
            [(u, k, v.name, pos) for v in graph.nodes for pos, (u, k) in enumerate(v.inputs)],
            lambda u, k: global_nbytes(by_name[u].strategies[0].outputs[k].meta), params, costs)
    return edge_share_table(params, parameter_uses(params, position, edges), least_fwd, least, sync_every,
                            windows, bounds)
