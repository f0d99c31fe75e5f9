"""The overlap term of the ILP (passes/solve/ilp.py states it with the rest of the model): the
shares of compute under which each parameter edge's collectives hide (cost_models/overlap.py),
so that the solver minimises the step evaluate() prices.

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

R' replaces R on every parameter edge (inside a group too), so the ILP keeps its rows
and columns: min() of a price and a constant is one more price. Dominance pruning
(passes/solve/dominance.py) reads the same R', and stays exact.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from autopar.core.kinds import NodeKind
from autopar.cost_models.overlap import Share, edge_share_table, global_nbytes, parameter_uses
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


def parameter_shares(graph: AnnotatedGraph, least: Sequence[float], least_fwd: Sequence[float],
                     sync_every: int = 1) -> dict[tuple[str, int], Share]:
    """(consumer, position) -> share[e] for every parameter edge of a training graph;
    `least`, `least_fwd`: least_backward and least_forward of its nodes; `sync_every`:
    Options.grad_sync_every (each backward pays 1/n of a bucket's reduction)."""
    params = [(n.name, global_nbytes(n.strategies[0].outputs[0].meta)) for n in graph.nodes
              if n.kind is NodeKind.PARAMETER and n.strategies]
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    edges = [(u, v.name, pos) for v in graph.nodes for pos, (u, _) in enumerate(v.inputs)]
    return edge_share_table(params, parameter_uses(params, position, edges), least_fwd, least, sync_every)
