"""Choices no optimal plan needs: dominance pruning of the ILP (passes/ilp.py) before
the solve, which gives the solver fewer s and far fewer x variables.

    IlpModel -> IlpModel with c[g,i] = INF (s[g,i] fixed at 0) for every dominated i

Choice j of group g dominates choice i when, for every copy of g (clustering: copies
share s) and every edge e between groups that touches one,

    c[g,j] <= c[g,i]                          (and m[g,j] <= m[g,i] when memory counts)
    R[e,o(j),r] <= R[e,o(i),r]  for every dst class r     (g is the edge's producer)
    R[e,o,r(j)] <= R[e,o,r(i)]  for every src class o     (g is the edge's consumer)

Why this is exact: in any plan that picks i, picking j instead changes only g's own
terms and its edges' terms, and each of them is no larger whatever the other end picks
(an edge between two copies of g changes on both ends: R[o(j),r(j)] <= R[o(i),r(j)] <=
R[o(i),r(i)]). Of two equal choices the lower index survives, which makes "j beats i" a
strict partial order: every pruned choice has a surviving dominator, and swapping
groups one at a time never raises the cost, so pruning every group at once keeps the
optimum (time; and the footprint too when memory is compared, which it is under a
budget, the only case the memory objective is solved). Rounds repeat on the survivors:
fewer classes on the other side can make more choices dominated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from autopar.cost_models.edge_prices import INF, EdgePricer
from autopar.passes.ilp import IlpModel, edge_classes

MAX_CELLS = 1 << 24  # compare at most this many profile entries at once (a few tens of MB)


def prune_dominated(model: IlpModel, pricer: EdgePricer, with_memory: bool) -> IlpModel:
    """`model` with its dominated choices made impossible (module docstring); `with_memory`:
    a choice must also need no more bytes to dominate."""
    own = _own_terms(model, with_memory)
    edges = _edge_tables(model, pricer)
    alive = {g: torch.tensor([c < INF for c in model.cost_s[g]]) for g in own}
    while True:
        pruned = {g: dominated(_profiles(g, own[g], edges, alive)[alive[g]], alive[g]) for g in own}
        if not any(pruned.values()):
            break
        for g, choices in pruned.items():
            alive[g][choices] = False
    cost = {g: tuple(c if alive[model.owner(g)][i] else INF for i, c in enumerate(cs))
            for g, cs in model.cost_s.items()}
    return replace(model, cost_s=cost)


@dataclass(frozen=True)
class EdgeTable:
    """One distinct edge between groups: R over its classes, and each choice's class."""

    producer: str  # the owner group on each end
    consumer: str
    src_class: torch.Tensor  # producer choice -> its src class (0 where impossible)
    dst_class: torch.Tensor  # consumer choice -> its dst class
    prices: torch.Tensor  # R[o, r] in seconds


def _own_terms(model: IlpModel, with_memory: bool) -> dict[str, torch.Tensor]:
    """Per owner group, choice x (c, and m when it counts, of every copy)."""
    cols: dict[str, list[list[float]]] = {}
    for g in model.leaders:
        cols.setdefault(model.owner(g), []).append(list(model.cost_s[g]))
        if with_memory:
            cols[model.owner(g)].append([float(b) for b in model.nbytes[g]])
    return {g: torch.tensor(c, dtype=torch.float64).T for g, c in cols.items()}


def _edge_tables(model: IlpModel, pricer: EdgePricer) -> list[EdgeTable]:
    tables, seen = [], set()
    for edge in model.edges:
        key = edge.twin_key(model.rep)
        if key in seen:  # a twin edge has the same classes and prices
            continue
        seen.add(key)
        src, dst = edge_classes(edge, model, pricer)
        u, v = model.owner(model.groups[edge.producer].leader), model.owner(model.groups[edge.consumer.name].leader)
        tables.append(EdgeTable(u, v, _class_of(src, len(model.cost_s[u])), _class_of(dst, len(model.cost_s[v])),
                                torch.tensor([[pricer.cost_between(o, r) for r in dst] for o in src],
                                             dtype=torch.float64)))
    return tables


def _class_of(classes: dict, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.long)
    for k, choices in enumerate(classes.values()):
        out[choices] = k
    return out


def _profiles(g: str, own: torch.Tensor, edges: list[EdgeTable], alive: dict[str, torch.Tensor]) -> torch.Tensor:
    """Choice x every coefficient that prices it: its own terms, and on each edge its row
    (or column) of R against the classes the other end can still pick."""
    blocks = [own]
    for t in edges:
        if t.producer == g:
            live = torch.zeros(t.prices.shape[1], dtype=torch.bool)
            live[t.dst_class[alive[t.consumer]]] = True
            blocks.append(t.prices[t.src_class][:, live])
        if t.consumer == g:
            live = torch.zeros(t.prices.shape[0], dtype=torch.bool)
            live[t.src_class[alive[t.producer]]] = True
            blocks.append(t.prices.T[t.dst_class][:, live])
    return torch.cat(blocks, dim=1)


def dominated(table: torch.Tensor, alive: torch.Tensor) -> list[int]:
    """The choices (indices among all, `alive` marking the rows of `table`) that another
    beats: no larger anywhere, and smaller somewhere or equal with a lower index."""
    n, width = table.shape
    if n < 2:
        return []
    beaten = torch.zeros(n, dtype=torch.bool)
    index = torch.arange(n)
    step = max(1, MAX_CELLS // max(1, n * width))
    for lo in range(0, n, step):  # j in [lo, lo + step) against every i
        j = table[lo:lo + step]
        no_larger = (j[:, None, :] <= table[None, :, :]).all(-1)  # [j, i]: j <= i everywhere
        equal = (j[:, None, :] == table[None, :, :]).all(-1)
        beaten |= (no_larger & (~equal | (index[lo:lo + step, None] < index[None, :]))).any(0)
    return alive.nonzero().flatten()[beaten].tolist()
