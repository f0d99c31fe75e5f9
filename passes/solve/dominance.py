"""Choices no optimal plan needs: dominance pruning of the ILP (passes/solve/ilp.py) before
the solve, which gives the solver fewer s and far fewer x variables.

    IlpModel -> IlpModel with c[g,i] = INF (s[g,i] fixed at 0) for every dominated i

For choices j and i of group g (over all copies of g, which share s under clustering,
and every edge e between groups that touches one; o(i) / r(i): i's class on e),

    D(j,i) = sum_copies (c[g,j] - c[g,i])
           + sum_e max_{r: R[e,o(i),r] < INF} (R[e,o(j),r] - R[e,o(i),r])   (g produces on e)
           + sum_e max_{o: R[e,o,r(i)] < INF} (R[e,o,r(j)] - R[e,o,r(i)])   (g consumes on e)

bounds what any plan that picks i gains by picking j instead, whatever the other ends
pick (Goldstein's dominance for pairwise costs). j beats i when D(j,i) <= 0, j needs no
more bytes when memory counts (under a budget, the only case the memory objective is
solved), and j comes first in the order (potential, index), the potential being
sum c + sum_e mean over the other end's classes of R: D(j,i) <= 0 implies j's potential
is no larger, so the order loses no pruning of a strictly better j, and it makes
"beats" acyclic. With recompute (passes/solve/recompute_ilp.py) a choice's forward seconds f
and dropped bytes a price too: j must also have f(j) <= f(i), kept bytes m - a no larger
(the bytes when its block recomputes), and on every edge into a block a forward price F
no worse against any class the other end can pick (edge by edge, as each block's r
takes its own edges). Why this keeps the optimum: D is subadditive (D(k,i) <= D(k,j) +
D(j,i)), so a chain of beats ends at a surviving choice that beats the start; swapping
groups one at a time to their surviving dominators never raises the cost (an edge
between two copies of g changes on both ends and is bounded by both terms), so pruning
every group at once is exact up to rounding. Rounds repeat on the survivors: fewer
classes on the other end can make more choices dominated.

R is the price the ILP uses: on a parameter's edge in training, R less what its
gradient bucket hides under backward (passes/solve/ilp_overlap.py), so pruning stays exact.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch

from autopar.cost_models.edge_prices import INF, EdgePricer
from autopar.passes.solve.ilp import Edge, IlpModel, edge_classes, forward_prices

MAX_CELLS = 1 << 24  # compare at most this many profile entries at once (a few tens of MB)
# columns each edge's cheap bound compares besides each choice's cheapest (_probed_difference)
PROBE_COLUMNS = 4
SLACK = 1e-9  # relative: what a sum of float64 prices may differ by when added in another order


def prune_dominated(model: IlpModel, pricer: EdgePricer, with_memory: bool,
                    forward: Optional[EdgePricer] = None) -> IlpModel:
    """`model` with its dominated choices made impossible (module docstring); `with_memory`:
    a choice must also need no more bytes to dominate; `forward`: the forward-only pricer
    of the recompute terms, where the model has blocks."""
    with _one_thread():
        extra = _recompute_terms(model, pricer, forward) if forward is not None and model.blocks else None
        return _prune(model, pricer, with_memory, extra)


@contextmanager
def _one_thread() -> Iterator[None]:
    """The comparisons are many small tensor ops: torch's intra-op threads only add
    synchronisation, and on a loaded machine their spin-waits cost several times the
    work (gemma3_text on (2, 4): 13 s of max() on 2 busy cores, 0.4 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _prune(model: IlpModel, pricer: EdgePricer, with_memory: bool, extra: Optional["RecomputeTerms"]) -> IlpModel:
    time_s, nbytes = _own_terms(model)
    edges = _by_group(_edge_tables(model, pricer))
    alive = {g: torch.tensor([c < INF for c in model.cost_s[g]]) for g in time_s}
    neighbours = {g: {t.consumer if produces else t.producer for t, produces in touching}
                  for g, touching in edges.items()}
    todo = list(time_s)
    while todo:
        # a group's verdict depends on its neighbours' live choices only (losing its own
        # beaten choices beats nothing new), so a round revisits the neighbours of the
        # groups the last one pruned: the same fixed point as revisiting every group
        pruned = {g: _beaten(g, time_s[g], nbytes[g] if with_memory else None, edges, alive, extra) for g in todo}
        changed = {g for g, choices in pruned.items() if choices}
        for g in changed:
            alive[g][pruned[g]] = False
        todo = [g for g in time_s if any(h in changed for h in neighbours.get(g, ()))]
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
    copies: int = 1  # the edge and its twins: each adds R to the objective


def _own_terms(model: IlpModel) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per owner group and choice: c and m summed over its copies (INF where impossible)."""
    time_s: dict[str, torch.Tensor] = {}
    nbytes: dict[str, torch.Tensor] = {}
    for g in model.leaders:
        o = model.owner(g)
        c = torch.tensor(model.cost_s[g], dtype=torch.float64)
        m = torch.tensor(model.nbytes[g], dtype=torch.float64)
        time_s[o] = time_s[o] + c if o in time_s else c
        nbytes[o] = nbytes[o] + m if o in nbytes else m
    return time_s, nbytes


def _edge_tables(model: IlpModel, pricer: EdgePricer) -> list[EdgeTable]:
    """One table per distinct edge; twins (copies of one edge under clustering) share its
    classes and prices but each adds its own term to the objective, so a table counts
    as many times as it has twins."""
    tables: dict[tuple, EdgeTable] = {}
    copies: dict[tuple, int] = {}
    for edge in model.edges:
        key = edge.twin_key(model.rep)
        copies[key] = copies.get(key, 0) + 1
        if key in tables:
            continue
        src, dst = edge_classes(edge, model, pricer)
        u, v = model.owner(model.groups[edge.producer].leader), model.owner(model.groups[edge.consumer.name].leader)
        tables[key] = EdgeTable(u, v, _class_of(src, len(model.cost_s[u])), _class_of(dst, len(model.cost_s[v])),
                                pricer.price_table(list(src), list(dst), edge.share))
    return [replace(t, copies=copies[key]) for key, t in tables.items()]


def _class_of(classes: dict, n: int) -> torch.Tensor:
    out = [0] * n
    for k, choices in enumerate(classes.values()):
        for i in choices:
            out[i] = k
    return torch.tensor(out, dtype=torch.long)


Touching = dict[str, list[tuple[EdgeTable, bool]]]  # group -> (table, g produces on it), in table order


def _by_group(tables: list[EdgeTable]) -> Touching:
    out: Touching = {}
    for t in tables:
        out.setdefault(t.producer, []).append((t, True))
        out.setdefault(t.consumer, []).append((t, False))
    return out


def _blocks(g: str, edges: Touching, alive: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Per edge touching g: each of g's live choices' row (or column) of R against the
    classes the other end can still pick, with the edge's number of copies."""
    out = []
    for t, produces in edges.get(g, ()):
        if produces:
            live = torch.zeros(t.prices.shape[1], dtype=torch.bool)
            live[t.dst_class[alive[t.consumer]]] = True
            out.append((t.prices[t.src_class[alive[g]]][:, live], t.copies))
        else:
            live = torch.zeros(t.prices.shape[0], dtype=torch.bool)
            live[t.src_class[alive[t.producer]]] = True
            out.append((t.prices.T[t.dst_class[alive[g]]][:, live], t.copies))
    return [(b, k) for b, k in out if b.shape[1]]


def _beaten(g: str, time_s: torch.Tensor, nbytes, edges: Touching,
            alive: dict[str, torch.Tensor], extra: Optional["RecomputeTerms"] = None) -> list[int]:
    """g's live choices that another live choice beats (module docstring)."""
    live = alive[g].nonzero().flatten()
    n = len(live)
    if n < 2:
        return []
    blocks = _blocks(g, edges, alive)
    c = time_s[live]
    own = c[:, None] - c[None, :]  # [j, i]
    potential = c + sum((k * b.mean(1) for b, k in blocks), torch.zeros(n, dtype=torch.float64))
    index = torch.arange(n)
    maybe = (potential[:, None] < potential[None, :]) | (
        (potential[:, None] == potential[None, :]) & (index[:, None] < index[None, :]))
    if nbytes is not None:
        m = nbytes[live]
        maybe &= m[:, None] <= m[None, :]
    if extra is not None:
        maybe &= extra.no_worse(g, live, nbytes)
    # D(j, i) is at least own + sum k * (the worst difference over a few probe columns):
    # the exact D is computed only for pairs that bound leaves j a chance, edge by edge,
    # each exact term replacing its probe bound and dropping the pairs it rules out. The
    # exact terms are added in the same order whatever survives, so D is the same sum
    probes = [k * _probed_difference(b) for b, k in blocks]
    bound = own + sum(probes, torch.zeros(n, n, dtype=torch.float64))
    # a pair leaves once its bound is positive beyond rounding (the bound's sums associate
    # differently from the exact D's): by more than SLACK of the terms' magnitudes
    scale = own.abs() + sum((p.abs().nan_to_num(posinf=0.0) for p in probes), torch.zeros(n, n, dtype=torch.float64))
    j, i = (maybe & (bound <= SLACK * scale)).nonzero(as_tuple=True)
    if extra is not None:  # the recompute edges, pair by pair: only the pairs the cheap tests left
        kept = extra.edges_no_worse(g, alive, j, i)
        j, i = j[kept], i[kept]
    gain, scale = own[j, i], scale[j, i]
    # rest[t]: the probe bounds of the edges after edge t summed (0 after the last edge).
    # Without edges the test above is exact: own <= SLACK * |own| only where own <= 0
    rest = torch.stack([p[j, i] for p in probes] + [torch.zeros(len(j), dtype=torch.float64)])
    rest = rest.flip(0).cumsum(0).flip(0)[1:]
    for t, (b, k) in enumerate(blocks):
        gain = gain + k * _pair_worst_difference(b, j, i)
        chance = gain + rest[t] <= (SLACK * scale if t + 1 < len(blocks) else 0.0)  # the last: D <= 0 itself
        j, i, gain, scale, rest = j[chance], i[chance], gain[chance], scale[chance], rest[:, chance]
    return live[i.unique()].tolist()


@dataclass(frozen=True)
class RecomputeTerms:
    """What recompute prices per owner group and choice, over its copies: forward
    seconds f and dropped bytes a; and the forward price F of the edges into blocks."""

    forward_s: dict[str, torch.Tensor]
    dropped: dict[str, torch.Tensor]
    edges: Touching

    def no_worse(self, g: str, live: torch.Tensor, nbytes) -> torch.Tensor:
        """[j, i]: j prices no more than i in g's own recompute terms, forward seconds
        and the bytes kept when its block recomputes (module docstring)."""
        ok = torch.ones(len(live), len(live), dtype=torch.bool)
        if g in self.forward_s:
            f = self.forward_s[g][live]
            ok &= f[:, None] <= f[None, :]
        if g in self.dropped and nbytes is not None:
            kept = nbytes[live] - self.dropped[g][live]
            ok &= kept[:, None] <= kept[None, :]
        return ok

    def edges_no_worse(self, g: str, alive: dict[str, torch.Tensor], j: torch.Tensor, i: torch.Tensor
                       ) -> torch.Tensor:
        """Per pair p (indices into g's live choices): j[p]'s forward price F is no worse
        than i[p]'s against every class the other end can pick, on every edge into a block.
        Pair by pair: the full [j, i] table is choices^2 x classes per edge, and on a mesh of
        three axes most groups are left with a few pairs to test by then."""
        ok = torch.ones(len(j), dtype=torch.bool)
        if not len(j):  # nothing left to test: the live tables need not be cut
            return ok
        for b, _ in _blocks(g, self.edges, alive):
            ok &= _pair_worst_difference(b, j, i) <= 0
        return ok


def _recompute_terms(model: IlpModel, pricer: EdgePricer, forward: EdgePricer) -> RecomputeTerms:
    forward_s: dict[str, torch.Tensor] = {}
    dropped: dict[str, torch.Tensor] = {}
    for block in model.blocks:
        for per_group, out in ((block.forward_s, forward_s), (block.dropped, dropped)):
            for g, values in per_group.items():
                o, v = model.owner(g), torch.tensor(values, dtype=torch.float64)
                out[o] = out[o] + v if o in out else v
    tables: dict[tuple, EdgeTable] = {}
    for k in sorted({k for block in model.blocks for k in block.edges}):
        edge = model.edges[k]
        key = edge.twin_key(model.rep)
        if key not in tables:
            src, dst = edge_classes(edge, model, pricer)
            u, v = model.owner(model.groups[edge.producer].leader), model.owner(model.groups[edge.consumer.name].leader)
            tables[key] = EdgeTable(u, v, _class_of(src, len(model.cost_s[u])), _class_of(dst, len(model.cost_s[v])),
                                    torch.tensor(forward_prices(edge, model, src, dst, forward), dtype=torch.float64))
    return RecomputeTerms(forward_s, dropped, _by_group(list(tables.values())))


def _probed_difference(b: torch.Tensor) -> torch.Tensor:
    """[j, i] -> max over probe columns r that i can meet of b[j, r] - b[i, r]: a lower
    bound of the worst difference (_pair_worst_difference: the max over all its columns).
    The probes are i's cheapest column, which makes the bound no looser than
    min_r b[j, r] - min_r b[i, r], and the PROBE_COLUMNS columns whose prices differ most
    between choices. -INF where i meets none."""
    n, width = b.shape
    cheapest = b.argmin(1)
    least = b[torch.arange(n), cheapest]
    out = torch.where((least < INF)[None, :], b[:, cheapest] - least[None, :], -INF)
    reachable = b < INF
    spread = torch.where(reachable, b, -INF).max(0).values - torch.where(reachable, b, INF).min(0).values
    for r in spread.topk(min(PROBE_COLUMNS, width)).indices.tolist():
        col = b[:, r]
        out = torch.maximum(out, torch.where((col < INF)[None, :], col[:, None] - col[None, :], -INF))
    return out


def _pair_worst_difference(b: torch.Tensor, j: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """For each pair p: the worst difference, the max over the columns r that i[p] can meet
    of b[j[p], r] - b[i[p], r] (-INF where it meets none)."""
    out = torch.empty(len(j), dtype=torch.float64)
    step = max(1, MAX_CELLS // max(1, b.shape[1]))
    for lo in range(0, len(j), step):
        bj, bi = b[j[lo:lo + step]], b[i[lo:lo + step]]
        out[lo:lo + step] = torch.where(bi < INF, bj - bi, -INF).max(-1).values
    return out


# ---- after the solve: among equally fast choices, the smaller footprint -------------

def prefer_smaller(model: IlpModel, picks: dict[str, int], pricer: EdgePricer,
                   keep: frozenset[str] = frozenset()) -> dict[str, int]:
    """`picks` with each group, in turn, moved to the choice with the fewest bytes among
    those that cost no more time against its neighbours' picks (each move keeps the
    plan's time and lowers its footprint). Under a budget the solver sees memory only as
    a constraint, so which of two equally fast layouts it returns is arbitrary; this
    makes it the smaller one. Groups in `keep` (as prune_dominated's) stay as picked."""
    picks = dict(picks)
    copies, touching = owner_neighbourhoods(model)
    for g, mine in copies.items():
        if g in keep:
            continue
        edges = touching[g]
        def local(i: int) -> tuple[float, int]:
            picks.update({h: i for h in mine})  # a trial, undone below unless it wins
            time_s = (sum(model.cost_s[h][i] for h in mine)
                      + sum(picked_edge_s(e, model, picks, pricer) for e in edges))
            return time_s, sum(model.nbytes[h][i] for h in mine)
        now = picks[g]
        now_s, now_bytes = local(now)
        options = [(nbytes, i) for i, c in enumerate(model.cost_s[g]) if c < INF
                   for time_s, nbytes in [local(i)] if time_s <= now_s and nbytes < now_bytes]
        best = min(options)[1] if options else now
        picks.update({h: best for h in mine})
    return picks


def owner_neighbourhoods(model: IlpModel) -> tuple[dict[str, list[str]], dict[str, list[Edge]]]:
    """Per owner group (a representative, in leader order): the groups that share its s
    (itself and its copies), and the edges touching any of them, an edge between two
    copies once."""
    copies: dict[str, list[str]] = {}
    for g in model.leaders:
        copies.setdefault(model.owner(g), []).append(g)
    touching: dict[str, dict[int, Edge]] = {g: {} for g in copies}
    for edge in model.edges:
        for end in (edge.producer, edge.consumer.name):
            touching[model.owner(model.groups[end].leader)][id(edge)] = edge
    return copies, {g: list(edges.values()) for g, edges in touching.items()}


def picked_edge_s(edge: Edge, model: IlpModel, picks: dict[str, int], pricer: EdgePricer) -> float:
    """R of `edge` under `picks` (less what its bucket hides, as the ILP prices it)."""
    mu, mv = model.groups[edge.producer], model.groups[edge.consumer.name]
    src = model.graph.node(edge.producer).strategies[mu.index_map[picks[mu.leader]]].outputs[edge.output]
    return pricer.price_s(src, edge.consumer.strategies[mv.index_map[picks[mv.leader]]], edge.position, edge.share)
