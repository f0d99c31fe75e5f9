"""A plan without the solver: each group, in graph order, takes its cheapest choice against
the choices already made. What a solve returns when the solver stopped at its time limit
before it had any plan of its own (passes/solve/solve.py), so a large model under a short
limit still gets a plan, marked as not optimal, instead of an error.

    IlpModel, EdgePricer -> group -> choice

Order: the groups of ops first, in graph order, each priced by its own cost and the
reshards from the producers already decided; then the groups of graph inputs (parameters,
user inputs), each priced against all its consumers, which are decided by then: a
parameter is stored as its readers want it (or as the reshard between them is cheapest)
instead of in whatever layout came first. A copy of a repeated block takes its
representative's choice, as it does in the ILP. No memory budget is looked at: the
caller checks the plan's bytes.
"""

from __future__ import annotations

from typing import Optional

from autopar.cost_models.edge_prices import INF, EdgePricer
from autopar.passes.solve.dominance import owner_neighbourhoods, picked_edge_s
from autopar.passes.solve.ilp import Edge, IlpModel


def greedy_picks(model: IlpModel, pricer: EdgePricer) -> Optional[dict[str, int]]:
    """Group -> choice (module docstring); None where some group has no choice whose
    reshards from what is decided are possible."""
    copies, touching = owner_neighbourhoods(model)
    inputs = [g for g in copies if model.graph.node(g).kind.is_input]
    picks: dict[str, int] = {}
    for g in [g for g in copies if not model.graph.node(g).kind.is_input] + inputs:
        mine, edges = copies[g], touching[g]
        best, best_s = None, INF
        for i, own in enumerate(model.cost_s[g]):
            if own >= INF:
                continue
            picks.update({h: i for h in mine})  # a trial: the last one is overwritten below
            time_s = sum(model.cost_s[h][i] for h in mine) + sum(
                picked_edge_s(e, model, picks, pricer) for e in edges if _decided(e, model, picks))
            if time_s < best_s:
                best, best_s = i, time_s
        if best is None:  # every choice needs a reshard autopar cannot do from what is decided
            return None
        picks.update({h: best for h in mine})
    return picks


def _decided(edge: Edge, model: IlpModel, picks: dict[str, int]) -> bool:
    return all(model.groups[end].leader in picks for end in (edge.producer, edge.consumer.name))
