"""The ILP of stage 4 (passes/solve.py), written as its math: Alpa's intra-op
formulation, with followers and spec classes.

    groups g      a leader node and the nodes that follow it; s[g,i] in {0,1}
    one-hot       sum_i s[g,i] = 1                                    for every group g
    edges e=(u,v) between groups; src class o = output spec of u under u's choice,
                  dst class r = (input spec, grad-sync axes) of v under v's choice;
                  x[e,o,r] >= 0 with
                  sum_r x[e,o,r] = sum_{i in o} s[gu,i]               for every o
                  sum_o x[e,o,r] = sum_{j in r} s[gv,j]               for every r
    memory        sum_g sum_i m[g,i] s[g,i] <= budget                 (Options.memory_budget_bytes)
    objective     min sum_g sum_i c[g,i] s[g,i] + sum_e sum_{o,r} R[e,o,r] x[e,o,r]
    or            min sum_g sum_i m[g,i] s[g,i]                       (the smallest footprint)

one_hot, edge_consistency and memory_budget add the constraint families, time_objective
and memory_objective are the two objectives, and build_ilp puts one ILP together;
ilp_model sums the coefficients per group and IlpVariables holds s and the x terms.

c[g,i] is the compute of every member under leader choice i plus the reshard cost of
edges inside the group (infinite where a member has no strategy for i: s[g,i] is then
no variable, i.e. fixed at 0); m[g,i] the members' bytes per rank
(cost_models/memory.py); R is the reshard cost (forward steps, and in training their
conjugates and gradient syncs) from class o to class r. An edge with one class on a
side needs no x: its cost is a plain term on the other side's s. Unreachable pairs
(e.g. S -> P) get no x, which forbids them. The memory-minimising objective prices
the footprint a MemoryBudgetError reports.

Clustering (passes/clusters.py): a group whose representative is another group reuses
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
from autopar.passes.solver_backend import LinearProgram
from autopar.passes.strategies import AnnotatedGraph, PlannedNode

US = 1e6  # the time objective is in microseconds, which keeps coefficients well scaled
MIB = 2**20  # the memory objective is in MiB, for the same reason

Variable = Optional[int]  # a column of the LinearProgram; None: a choice that is impossible, i.e. fixed at 0


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

    def twin_key(self, rep: Mapping[str, str]) -> tuple[str, int, str, int]:
        """Edges with the same key share their x variables (clustering)."""
        v, u = self.consumer.name, self.producer
        return rep.get(v, v), self.position, rep.get(u, u), self.output


@dataclass(frozen=True)
class IlpModel:
    """The coefficients of the ILP; a group is named by its leader."""

    graph: AnnotatedGraph
    groups: Mapping[str, Member]  # node -> its place in its group
    leaders: tuple[str, ...]  # every group: representatives first, then copies, each in graph order
    rep: Mapping[str, str]  # node -> the representative whose variables it reuses (passes/clusters.py)
    cost_s: Mapping[str, tuple[float, ...]]  # c[g,i] in seconds (INF: impossible)
    nbytes: Mapping[str, tuple[int, ...]]  # m[g,i] in bytes per rank
    edges: tuple[Edge, ...]  # the edges between groups, in graph order

    def owner(self, group: str) -> str:
        """The group whose s variables `group` uses: its representative, or itself."""
        return self.rep.get(group, group)


def ilp_model(graph: AnnotatedGraph, groups: Mapping[str, Member], pricer: EdgePricer,
              node_cost_s: Mapping[str, list[float]], node_nbytes: Mapping[str, list[int]],
              rep: Optional[Mapping[str, str]] = None) -> IlpModel:
    """c[g,i] = sum over members n of compute[n, index_map_n(i)]
               + sum over edges (u,v) inside g of R(u's output under i -> v under i);
    m[g,i] = sum over members n of bytes[n, index_map_n(i)]."""
    rep = rep or {}
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
            edge = Edge(v, pos, u, k)
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
            cost[i] += pricer.cost_s(src, edge.consumer.strategies[vi], edge.position)


# ---- variables and linear terms ----------------------------------------------------

class LinearTerms:
    """sum_v a_v v + constant, accumulated per variable (column)."""

    def __init__(self) -> None:
        self.coef: dict[int, float] = {}
        self.constant = 0.0

    def add(self, var: Variable, c: float) -> None:
        if var is None:
            self.constant += c
        elif c:
            self.coef[var] = self.coef.get(var, 0.0) + c

    def extend(self, other: LinearTerms) -> None:
        self.constant += other.constant
        for var, c in other.coef.items():
            self.coef[var] = self.coef.get(var, 0.0) + c



@dataclass(frozen=True)
class IlpVariables:
    """The decision variables: s directly, x through the reshard terms that use them."""

    s: Mapping[str, tuple[Variable, ...]]  # s[g,i] in IlpModel.leaders order; a copy holds its representative's
    reshard: tuple[LinearTerms, ...]  # sum_{o,r} R[e,o,r] x[e,o,r] (microseconds) per IlpModel.edges; twins share one
    count: int  # variables created (a shared variable counts once)
    groups: int  # groups with their own s (after following and clustering)


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
                  budget_bytes: int) -> None:
    """sum_g sum_i m[g,i] s[g,i] <= budget (a copy's bytes count on its representative's s)."""
    terms = LinearTerms()
    for g in model.leaders:
        for i, var in enumerate(s[g]):
            if var is not None:
                terms.add(var, float(model.nbytes[g][i]))
    prob.row(terms.coef, -INF, float(budget_bytes))


def edge_consistency(prob: LinearProgram, model: IlpModel, s: Mapping[str, tuple[Variable, ...]],
                     pricer: EdgePricer) -> tuple[tuple[LinearTerms, ...], int]:
    """For every edge e = (u, v) between groups, with src classes o and dst classes r,

        sum_r x[e,o,r] = sum_{i in o} s[gu,i]   for every o
        sum_o x[e,o,r] = sum_{j in r} s[gv,j]   for every r,   x[e,o,r] >= 0,

    with no x[e,o,r] where R[e,o,r] is infinite. Classes whose rows (or columns) of R
    are equal are merged first (_merge_alike). An edge with one class on a side needs
    no x (its cost is a term on the other side's s; an impossible pair fixes that s at
    0), nor does one whose every pair costs the same (its cost is a constant). Returns
    each edge's reshard cost sum_{o,r} R[e,o,r] x[e,o,r] in microseconds, twins sharing
    one, and how many x it created."""
    built: dict[tuple[str, int, str, int], LinearTerms] = {}
    reshard: list[LinearTerms] = []
    created = 0
    for edge in model.edges:
        key = edge.twin_key(model.rep)
        if key not in built:
            src, dst = _classes(edge, model, s, pricer)
            matrix = [[pricer.cost_between(o, r) for r in dst] for o in src]
            built[key], n = _link_classes(prob, *_merge_alike(list(src.values()), list(dst.values()), matrix))
            created += n
        reshard.append(built[key])
    return tuple(reshard), created


Classes = list[list[int]]  # per class, the s variables that choose it


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


def _classes(edge: Edge, model: IlpModel, s: Mapping[str, tuple[Variable, ...]], pricer: EdgePricer
             ) -> tuple[dict[int, list[int]], dict[DstKey, list[int]]]:
    """edge_classes with the s variables of the choices."""
    src, dst = edge_classes(edge, model, pricer)
    su, sv = s[model.groups[edge.producer].leader], s[model.groups[edge.consumer.name].leader]
    return ({o: [su[i] for i in idx] for o, idx in src.items()},
            {r: [sv[i] for i in idx] for r, idx in dst.items()})


def _merge_alike(src: Classes, dst: Classes, matrix: list[list[float]]
                 ) -> tuple[Classes, Classes, list[list[float]]]:
    """Merges src classes with equal rows of R, then dst classes with equal columns,
    until none are left. Exact, for the LP relaxation too: a flow into two equal
    columns splits in proportion to their marginals, at the same cost, and back."""
    while True:
        rows: dict[tuple[float, ...], int] = {}
        merged_src: Classes = []
        for vars_, row in zip(src, matrix):
            k = rows.setdefault(tuple(row), len(rows))
            if k == len(merged_src):
                merged_src.append([])
            merged_src[k].extend(vars_)
        cols: dict[tuple[float, ...], int] = {}
        merged_dst: Classes = []
        for r, vars_ in enumerate(dst):
            k = cols.setdefault(tuple(row[r] for row in rows), len(cols))
            if k == len(merged_dst):
                merged_dst.append([])
            merged_dst[k].extend(vars_)
        if len(merged_src) == len(src) and len(merged_dst) == len(dst):
            return src, dst, matrix
        columns = list(cols)
        src, dst, matrix = merged_src, merged_dst, [list(row) for row in zip(*columns)]


def _link_classes(prob: LinearProgram, src: Classes, dst: Classes, matrix: list[list[float]]
                  ) -> tuple[LinearTerms, int]:
    """An edge's constraints and cost terms, without x where a side has one class."""
    terms = LinearTerms()
    if len(src) == 1 and len(dst) == 1 and matrix[0][0] < INF:
        terms.add(None, matrix[0][0] * US)
        return terms, 0
    if len(src) == 1:
        for r, vars_ in enumerate(dst):
            for var in vars_:
                _add_or_forbid(prob, terms, var, matrix[0][r])
        return terms, 0
    if len(dst) == 1:
        for o, vars_ in enumerate(src):
            for var in vars_:
                _add_or_forbid(prob, terms, var, matrix[o][0])
        return terms, 0
    by_src: list[dict[int, float]] = [{var: -1.0 for var in vars_} for vars_ in src]
    by_dst: list[dict[int, float]] = [{var: -1.0 for var in vars_} for vars_ in dst]
    created = 0
    for o, row in enumerate(matrix):
        for r, cost in enumerate(row):
            if cost < INF:
                x = prob.column(binary=False)
                terms.add(x, cost * US)
                by_src[o][x] = by_dst[r][x] = 1.0
                created += 1
    for coef in by_src + by_dst:  # sum of the flows = the marginal, as sum coef[v] v = 0
        prob.row(coef, 0.0, 0.0)
    return terms, created


def _add_or_forbid(prob: LinearProgram, terms: LinearTerms, var: int, cost_s: float) -> None:
    if cost_s == INF:
        prob.fix_zero(var)
    else:
        terms.add(var, cost_s * US)


# ---- objectives --------------------------------------------------------------------

def time_objective(model: IlpModel, v: IlpVariables) -> LinearTerms:
    """min sum_g sum_i c[g,i] s[g,i] + sum_e sum_{o,r} R[e,o,r] x[e,o,r], in microseconds;
    every copy of a group or an edge adds its own terms."""
    terms = LinearTerms()
    for g in model.leaders:
        for i, var in enumerate(v.s[g]):
            if var is not None:
                terms.add(var, model.cost_s[g][i] * US)
    for edge_terms in v.reshard:
        terms.extend(edge_terms)
    return terms


def memory_objective(model: IlpModel, v: IlpVariables) -> LinearTerms:
    """min sum_g sum_i m[g,i] s[g,i], in MiB: the smallest footprint, whatever the time."""
    terms = LinearTerms()
    for g in model.leaders:
        for i, var in enumerate(v.s[g]):
            if var is not None:
                terms.add(var, model.nbytes[g][i] / MIB)
    return terms


# ---- the whole ILP -----------------------------------------------------------------

def build_ilp(model: IlpModel, pricer: EdgePricer, objective: Objective = time_objective,
              budget_bytes: Optional[int] = None) -> Ilp:
    """One-hot and edge consistency, the memory budget when there is one, and `objective`."""
    prob = LinearProgram()
    s = one_hot(prob, model)
    if budget_bytes is not None:
        memory_budget(prob, model, s, budget_bytes)
    reshard, n_x = edge_consistency(prob, model, s, pricer)
    own = [g for g in model.leaders if model.rep.get(g, g) == g]
    n_s = sum(var is not None for g in own for var in s[g])
    variables = IlpVariables(s, reshard, n_s + n_x, len(own))
    terms = objective(model, variables)
    prob.minimise(terms.coef, terms.constant)
    return Ilp(prob, variables)
