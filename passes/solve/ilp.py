"""The ILP of stage 4 (passes/solve/solve.py), written as its math: Alpa's intra-op
formulation, with followers and spec classes.

    groups g      a leader node and the nodes that follow it; s[g,i] in {0,1}
    one-hot       sum_i s[g,i] = 1                                    for every group g
    edges e=(u,v) between groups; src class o = output spec of u under u's choice,
                  dst class r = (input spec, grad-sync axes) of v under v's choice;
                  x[e,o,r] >= 0 with
                  sum_r x[e,o,r] = sum_{i in o} s[gu,i]               for every o
                  sum_o x[e,o,r] = sum_{j in r} s[gv,j]               for every r
    recompute     training under a budget only: blocks b (repeated layers, passes/strategies/clusters.py),
                  r[b] in {0,1}: b's activations are recomputed in backward, not kept
                  w[b,g,i] = s[g,i] r[b]:  w <= s[g,i],  sum_i w[b,g,i] = r[b]
                  z[b,e] >= sum_{o,r} F[e,o,r] x[e,o,r] - Fmax[e] (1 - r[b]), z >= 0   (e into b)
                  D_b = sum_g sum_i a[b,g,i] w[b,g,i]     bytes of b's outputs read only inside b
                  T_b = sum_g sum_i f[b,g,i] w[b,g,i] + sum_{e into b} z[b,e]
                                                          b's forward once more: compute, reshards
                  r[b] >= r[b']                           b before b', twins (equal terms: symmetry)
    memory        sum_g sum_i m[g,i] s[g,i] - sum_b D_b <= budget          (Options.memory_budget_bytes)
    objective     min sum_g sum_i c[g,i] s[g,i] + sum_e sum_{o,r} R[e,o,r] x[e,o,r] + sum_b T_b
    or            min sum_g sum_i m[g,i] s[g,i] - sum_b D_b                (the smallest footprint)

one_hot, edge_consistency, recompute and memory_budget add the constraint families, time_objective
and memory_objective are the two objectives, and build_ilp puts one ILP together;
ilp_model sums the coefficients per group and IlpVariables holds s and the x terms.

c[g,i] is the compute of every member under leader choice i plus the reshard cost of
edges inside the group (infinite where a member has no strategy for i: s[g,i] is then
no variable, i.e. fixed at 0); m[g,i] the members' bytes per rank
(cost_models/memory.py); R is the reshard cost (forward steps, and in training their
conjugates and gradient syncs) from class o to class r; on a parameter's edge in
training, less what its gradient bucket hides under backward, min(H, share[e])
(passes/solve/ilp_overlap.py), so the objective is the overlapped step evaluate() prices
(inside a group too: c[g,i] carries the same price). An edge with one class on a
side needs no x: its cost is a plain term on the other side's s. Unreachable pairs
(e.g. S -> P) get no x, which forbids them. The memory-minimising objective prices
the footprint a MemoryBudgetError reports (every block recomputed, where that helps).

Recompute: a[b,g,i] are the bytes m of g's members in b none of whose consumers is
outside b (an output read outside b stays kept, as torch.utils.checkpoint keeps a
region's inputs and outputs); f[b,g,i] their forward seconds (the training compute
without its backward share) plus the forward steps of reshards inside g into b's nodes;
F[e,o,r] the forward steps of R (passes/solve/recompute_ilp.py prices them). w is the exact
product of a group's one-hot s with r[b]; z is F r[b] at the optimum (big-M, Fmax the
largest F of the edge: one flow pair is chosen).
Without a budget recompute only costs time, so no r is made.

Clustering (passes/strategies/clusters.py): a group whose representative is another group reuses
that group's s, and an edge whose two ends have the same representatives as an earlier
edge reuses its x; every copy still adds its own terms to the objective, so the
objective prices each block and each boundary.

Coefficients are scaled for the solver: time in microseconds (US), bytes in MiB (MIB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from autopar.core.errors import SolverError
from autopar.cost_models.edge_prices import INF, DstKey, EdgePricer
from autopar.cost_models.hiding import NO_SHARE, Share
from autopar.passes.solve.ilp_terms import MIB, US, Flow, LinearTerms, Variable, link_classes, merge_alike
from autopar.passes.solve.recompute_ilp import BlockTerms, RecomputeVariables, recompute
from autopar.passes.solve.solver_backend import LinearProgram
from autopar.passes.strategies.strategies import AnnotatedGraph, PlannedNode

# ---- coefficients ------------------------------------------------------------------

@dataclass(frozen=True)
class Member:
    """A node's place in its group."""

    leader: str
    index_map: tuple[int, ...]  # leader strategy index -> this node's strategy index (-1: impossible)


@dataclass(frozen=True)
class Edge:
    """Input `position` of `consumer` reads output `output` of `producer`."""

    consumer: PlannedNode
    position: int
    producer: str
    output: int
    share: Share = NO_SHARE  # a parameter edge's shares of the compute its collectives hide under (ilp_overlap.py)

    def twin_key(self, rep: Mapping[str, str]) -> tuple[str, int, str, int, float]:
        """Edges with the same key share their x variables (clustering); a twin whose
        bucket hides a different share is priced apart."""
        v, u = self.consumer.name, self.producer
        return rep.get(v, v), self.position, rep.get(u, u), self.output, self.share


@dataclass(frozen=True)
class IlpModel:
    """The coefficients of the ILP; a group is named by its leader."""

    graph: AnnotatedGraph
    groups: Mapping[str, Member]  # node -> its place in its group
    leaders: tuple[str, ...]  # every group: representatives first, then copies, each in graph order
    rep: Mapping[str, str]  # node -> the representative whose variables it reuses (passes/strategies/clusters.py)
    cost_s: Mapping[str, tuple[float, ...]]  # c[g,i] in seconds (INF: impossible)
    nbytes: Mapping[str, tuple[int, ...]]  # m[g,i] in bytes per rank
    edges: tuple[Edge, ...]  # the edges between groups, in graph order
    blocks: tuple[BlockTerms, ...] = ()  # the recompute family's terms; () when recompute is off

    def owner(self, group: str) -> str:
        """The group whose s variables `group` uses: its representative, or itself."""
        return self.rep.get(group, group)


def ilp_model(graph: AnnotatedGraph, groups: Mapping[str, Member], pricer: EdgePricer,
              node_cost_s: Mapping[str, list[float]], node_nbytes: Mapping[str, list[int]],
              rep: Optional[Mapping[str, str]] = None, shares: Optional[Mapping[tuple[str, int], Share]] = None
              ) -> IlpModel:
    """c[g,i] = sum over members n of compute[n, index_map_n(i)]
               + sum over edges (u,v) inside g of R(u's output under i -> v under i);
    m[g,i] = sum over members n of bytes[n, index_map_n(i)]. `shares`: (consumer,
    position) -> the share of backward a parameter edge's bucket hides under
    (passes/solve/ilp_overlap.py); R is then R - min(H, share)."""
    rep = rep or {}
    shares = shares or {}
    leaders = [n for n in graph.nodes if groups[n.name].leader == n.name]
    cost = {L.name: [0.0] * len(L.strategies) for L in leaders}
    nbytes = {L.name: [0] * len(L.strategies) for L in leaders}
    for n in graph.nodes:
        m = groups[n.name]
        for i, j in enumerate(m.index_map):
            cost[m.leader][i] += INF if j < 0 else node_cost_s[n.name][j]
            nbytes[m.leader][i] += 0 if j < 0 else node_nbytes[n.name][j]
    between: list[Edge] = []
    for v in graph.nodes:
        for pos, (u, k) in enumerate(v.inputs):
            edge = Edge(v, pos, u, k, shares.get((v.name, pos), NO_SHARE))
            if groups[u].leader != groups[v.name].leader:
                between.append(edge)
            else:
                _add_inner_reshard(cost[groups[u].leader], edge, graph, groups, pricer)
    order = sorted((L.name for L in leaders), key=lambda g: rep.get(g, g) != g)  # representatives first
    return IlpModel(graph, groups, tuple(order), rep, {g: tuple(c) for g, c in cost.items()},
                    {g: tuple(m) for g, m in nbytes.items()}, tuple(between))


def _add_inner_reshard(cost: list[float], edge: Edge, graph: AnnotatedGraph, groups: Mapping[str, Member],
                       pricer: EdgePricer) -> None:
    producer = graph.node(edge.producer)
    mu, mv = groups[edge.producer], groups[edge.consumer.name]
    for i, (ui, vi) in enumerate(zip(mu.index_map, mv.index_map)):
        if ui >= 0 and vi >= 0:
            src = producer.strategies[ui].outputs[edge.output]
            cost[i] += pricer.price_s(src, edge.consumer.strategies[vi], edge.position, edge.share)


# ---- variables and linear terms ----------------------------------------------------

@dataclass(frozen=True)
class IlpVariables:
    """The decision variables: s directly, x through the reshard terms that use them."""

    s: Mapping[str, tuple[Variable, ...]]  # s[g,i] in IlpModel.leaders order; a copy holds its representative's
    reshard: tuple[LinearTerms, ...]  # sum_{o,r} R[e,o,r] x[e,o,r] (microseconds) per IlpModel.edges; twins share one
    count: int  # variables created (a shared variable counts once)
    groups: int  # groups with their own s (after following and clustering)
    recompute: RecomputeVariables = RecomputeVariables()  # r and its product terms per IlpModel.blocks
    flows: tuple[Flow, ...] = ()  # every x made, with the s columns of its two classes (build_ilp's list_flows)


@dataclass(frozen=True)
class Ilp:
    program: LinearProgram
    variables: IlpVariables


Objective = Callable[[IlpModel, IlpVariables], LinearTerms]


# ---- constraint families -----------------------------------------------------------

def one_hot(prob: LinearProgram, model: IlpModel) -> dict[str, tuple[Variable, ...]]:
    """sum_i s[g,i] = 1 for every group g; s[g,i] is no variable (fixed at 0) where
    c[g,i] is infinite. A copy reuses its representative's s, and so its constraint."""
    s: dict[str, tuple[Variable, ...]] = {}
    for g in model.leaders:
        twin = model.rep.get(g, g)
        if twin != g:
            s[g] = s[twin]
            continue
        s[g] = tuple(None if c == INF else prob.column(binary=True) for c in model.cost_s[g])
        if all(var is None for var in s[g]):
            raise SolverError(f"node {g} ({model.graph.node(g).op}) has no feasible strategy on mesh "
                              f"{model.graph.mesh.shape}: every choice needs a reshard autopar cannot do")
        prob.row({var: 1.0 for var in s[g] if var is not None}, 1.0, 1.0)
    return s


def memory_budget(prob: LinearProgram, model: IlpModel, s: Mapping[str, tuple[Variable, ...]],
                  budget_bytes: int, rec: RecomputeVariables = RecomputeVariables()) -> None:
    """sum_g sum_i m[g,i] s[g,i] - sum_b D_b <= budget (a copy's bytes count on its
    representative's s; no blocks, no recompute terms)."""
    prob.row(_memory_terms(model, s, rec).coef, -INF, float(budget_bytes))


def _memory_terms(model: IlpModel, s: Mapping[str, tuple[Variable, ...]], rec: RecomputeVariables) -> LinearTerms:
    """The bytes per rank, as the memory row and objective count them."""
    terms = LinearTerms()
    for g in model.leaders:
        for i, var in enumerate(s[g]):
            if var is not None:
                terms.add(var, float(model.nbytes[g][i]))
    for dropped in rec.dropped:
        for var, c in dropped.coef.items():
            terms.add(var, -c)
    return terms


def edge_consistency(prob: LinearProgram, model: IlpModel, s: Mapping[str, tuple[Variable, ...]],
                     pricer: EdgePricer, forward: Optional[EdgePricer] = None, flows: Optional[list[Flow]] = None
                     ) -> tuple[tuple[LinearTerms, ...], tuple[LinearTerms, ...], int]:
    """For every edge e = (u, v) between groups, with src classes o and dst classes r,

        sum_r x[e,o,r] = sum_{i in o} s[gu,i]   for every o
        sum_o x[e,o,r] = sum_{j in r} s[gv,j]   for every r,   x[e,o,r] >= 0,

    with no x[e,o,r] where R[e,o,r] is infinite. Classes whose rows (or columns) of R
    are equal are merged first (ilp_terms.merge_alike; for an edge into a block, rows
    of the pairs (R, F)). An edge with one class on a side needs no x (its cost is a
    term on the other side's s; an impossible pair fixes that s at 0), nor does one
    whose every pair costs the same (its cost is a constant). Returns each edge's
    reshard cost sum_{o,r} R[e,o,r] x[e,o,r] and its forward part sum F x (`forward`
    prices F, for the edges into blocks only) in microseconds, twins sharing one, and
    how many x it created (each listed in `flows`)."""
    into_blocks = {model.edges[k].twin_key(model.rep) for b in model.blocks for k in b.edges}
    built: dict[tuple[str, int, str, int, Share], tuple[LinearTerms, LinearTerms]] = {}
    reshard, rerun = [], []
    created = 0
    for edge in model.edges:
        key = edge.twin_key(model.rep)
        if key not in built:
            src, dst = edge_classes(edge, model, pricer)
            matrix: list[list] = pricer.price_table(list(src), list(dst), edge.share).tolist()
            with_forward = forward is not None and key in into_blocks
            if with_forward:
                matrix = [list(zip(row, fwd)) for row, fwd in zip(matrix, forward_prices(edge, model, src, dst, forward))]
            su, sv = s[model.groups[edge.producer].leader], s[model.groups[edge.consumer.name].leader]
            src_vars = [[su[i] for i in idx] for idx in src.values()]
            dst_vars = [[sv[i] for i in idx] for idx in dst.values()]
            *built[key], n = link_classes(prob, *merge_alike(src_vars, dst_vars, matrix), with_forward, flows)
            created += n
        reshard.append(built[key][0])
        rerun.append(built[key][1])
    return tuple(reshard), tuple(rerun), created


def forward_prices(edge: Edge, model: IlpModel, src: dict[int, list[int]], dst: dict[DstKey, list[int]],
               forward: EdgePricer) -> list[list[float]]:
    """F[e,o,r]: the forward steps of the reshard from class o to class r (a class's
    first choice stands for it: its spec and grad-sync axes decide the steps)."""
    producer = model.graph.node(edge.producer)
    mu, mv = model.groups[edge.producer], model.groups[edge.consumer.name]
    outs = [producer.strategies[mu.index_map[idx[0]]].outputs[edge.output] for idx in src.values()]
    reads = [edge.consumer.strategies[mv.index_map[idx[0]]] for idx in dst.values()]
    return [[forward.cost_s(out, read, edge.position) for read in reads] for out in outs]


def edge_classes(edge: Edge, model: IlpModel, pricer: EdgePricer
                 ) -> tuple[dict[int, list[int]], dict[DstKey, list[int]]]:
    """The src classes o (u's output spec) and dst classes r (v's input spec and
    grad-sync axes: consumer strategies that price alike), each with the choices of its
    group (leader strategy indices) that pick it; impossible choices (c infinite) in none."""
    producer, pos = model.graph.node(edge.producer), edge.position
    mu, mv = model.groups[edge.producer], model.groups[edge.consumer.name]
    cu, cv = model.cost_s[model.owner(mu.leader)], model.cost_s[model.owner(mv.leader)]
    src: dict[int, list[int]] = {}
    for i, j in enumerate(mu.index_map):
        if j >= 0 and cu[i] < INF:
            src.setdefault(pricer.spec_id(producer.strategies[j].outputs[edge.output]), []).append(i)
    dst: dict[DstKey, list[int]] = {}
    for i, j in enumerate(mv.index_map):
        if j >= 0 and cv[i] < INF:
            dst.setdefault(pricer.dst_key(edge.consumer.strategies[j], pos), []).append(i)
    return src, dst


# ---- objectives --------------------------------------------------------------------

def time_objective(model: IlpModel, v: IlpVariables) -> LinearTerms:
    """min sum_g sum_i c[g,i] s[g,i] + sum_e sum_{o,r} R[e,o,r] x[e,o,r] + sum_b T_b, in
    microseconds; every copy of a group or an edge adds its own terms."""
    terms = LinearTerms()
    for g in model.leaders:
        for i, var in enumerate(v.s[g]):
            if var is not None:
                terms.add(var, model.cost_s[g][i] * US)
    for edge_terms in v.reshard:
        terms.extend(edge_terms)
    for rerun in v.recompute.rerun:
        terms.extend(rerun)
    return terms


def memory_objective(model: IlpModel, v: IlpVariables) -> LinearTerms:
    """min sum_g sum_i m[g,i] s[g,i] - sum_b D_b, in MiB: the smallest footprint,
    whatever the time (every block that can recompute does)."""
    terms = LinearTerms()
    for var, c in _memory_terms(model, v.s, v.recompute).coef.items():
        terms.add(var, c / MIB)
    return terms


def priced_memory_objective(price_s_per_byte: float) -> Objective:
    """min time + price x memory (each in its objective's units: microseconds, and MiB
    at price x US x MIB microseconds each): one point of the time-memory frontier."""
    per_mib = price_s_per_byte * US * MIB

    def objective(model: IlpModel, v: IlpVariables) -> LinearTerms:
        terms = time_objective(model, v)
        for var, c in memory_objective(model, v).coef.items():
            terms.add(var, c * per_mib)
        return terms
    return objective


# ---- the whole ILP -----------------------------------------------------------------

def build_ilp(model: IlpModel, pricer: EdgePricer, objective: Objective = time_objective,
              budget_bytes: Optional[int] = None, forward: Optional[EdgePricer] = None,
              list_flows: bool = False) -> Ilp:
    """One-hot and edge consistency, recompute where the model has blocks (`forward`
    prices their reshards' forward steps), the memory budget when there is one, and
    `objective`. Without blocks the rows and columns come in the order they always did.
    `list_flows`: IlpVariables.flows lists every x (for a starting solution)."""
    prob = LinearProgram()
    s = one_hot(prob, model)
    if budget_bytes is not None and not model.blocks:
        memory_budget(prob, model, s, budget_bytes)
    flows: Optional[list[Flow]] = [] if list_flows else None
    reshard, rerun, n_x = edge_consistency(prob, model, s, pricer, forward, flows)
    before = len(prob.cost)
    rec = recompute(prob, model, s, rerun) if model.blocks else RecomputeVariables()
    n_r = len(prob.cost) - before
    if budget_bytes is not None and model.blocks:
        memory_budget(prob, model, s, budget_bytes, rec)
    own = [g for g in model.leaders if model.rep.get(g, g) == g]
    n_s = sum(var is not None for g in own for var in s[g])
    variables = IlpVariables(s, reshard, n_s + n_x + n_r, len(own), rec, tuple(flows or ()))
    terms = objective(model, variables)
    prob.minimise(terms.coef, terms.constant)
    return Ilp(prob, variables)
