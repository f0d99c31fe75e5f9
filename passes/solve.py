"""Stage 4: choose one strategy per node with an integer linear program.

    AnnotatedGraph + CostModel + Options -> Plan

The model (Alpa's intra-op formulation, with followers and spec classes):

    groups g      a leader node and the nodes that follow it; s[g,i] in {0,1}
    one-hot       sum_i s[g,i] = 1                                    for every group g
    edges e=(u,v) between groups; src class o = output spec of u under u's choice,
                  dst class r = (input spec, grad-sync axes) of v under v's choice;
                  x[e,o,r] >= 0 with
                  sum_r x[e,o,r] = sum_{i in o} s[gu,i]               for every o
                  sum_o x[e,o,r] = sum_{j in r} s[gv,j]               for every r
    memory        sum_g sum_i m[g,i] s[g,i] <= budget                 (Options.memory_budget_bytes)
    objective     min sum_g sum_i c[g,i] s[g,i] + sum_e sum_{o,r} R[e,o,r] x[e,o,r]

c[g,i] is the compute of every member under leader choice i plus the reshard cost of
edges inside the group; m[g,i] the members' bytes per rank (cost_models/memory.py);
R is the reshard cost (forward steps, and in training their
conjugates and gradient syncs) from class o to class r. An edge with one class on a
side needs no x: its cost is a plain term on the other side's s. Unreachable pairs
(e.g. S -> P) get no x, which forbids them.

Followers (Options.follow): a single-input op follows its producer, taking for each
producer choice its cheapest strategy; getitem follows its tuple; a placeholder used
once follows its consumer and is stored in the layout the consumer reads.

Clustering (Options.cluster_layers, passes/clusters.py): the groups of a repeated block
reuse the s variables of their twin in the first such block, and an edge whose two ends
have the same representatives as an earlier edge reuses its x variables; every copy
still adds its own cost terms, so the objective prices each block and each boundary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import pulp

from autopar.core.errors import MemoryBudgetError, SolverError
from autopar.core.options import Options
from autopar.core.kinds import NodeKind
from autopar.core.placement import R, Spec
from autopar.core.plan import Plan
from autopar.core.plan_parts import Alternative, EdgePlan, NodeChoice, SolverReport
from autopar.core.resharding import Step, Unreachable, reshard_steps, split_axes
from autopar.cost_models.memory import node_bytes
from autopar.cost_models.model import CostModel
from autopar.passes.clusters import MODES, cluster, find_blocks
from autopar.passes.rules import Strategy
from autopar.passes.solver_backend import gap, quiet_stdout, solver_for
from autopar.passes.strategies import AnnotatedGraph, PlannedNode

INF = float("inf")
US = 1e6  # the objective is in microseconds, which keeps coefficients well scaled


@dataclass(frozen=True)
class Member:
    leader: str
    index_map: tuple[int, ...]  # leader strategy index -> this node's strategy index (-1: impossible)


def grad_sync_axes(strategy: Strategy, position: int) -> tuple[int, ...]:
    dst = strategy.inputs[position]
    return tuple(a for a in split_axes(strategy.inputs, strategy.outputs) if dst.placements[a] == R)


class EdgePricer:
    """Reshard steps and their cost per (source spec, consumer strategy, position), memoised."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self._steps = lru_cache(maxsize=None)(self._compute_steps)

    @staticmethod
    def _compute_steps(src: Spec, dst: Spec, gsa: tuple[int, ...]) -> Optional[tuple[Step, ...]]:
        try:
            return reshard_steps(src, dst, gsa)
        except Unreachable:
            return None

    def steps(self, src: Spec, consumer: Strategy, position: int) -> Optional[tuple[Step, ...]]:
        return self._steps(src, consumer.inputs[position], grad_sync_axes(consumer, position))

    def cost_s(self, src: Spec, consumer: Strategy, position: int) -> float:
        steps = self.steps(src, consumer, position)
        return INF if steps is None else self.costs.steps_cost(steps).total_s


def node_costs(graph: AnnotatedGraph, costs: CostModel) -> dict[str, list[float]]:
    out = {}
    for n in graph.nodes:
        if n.call is None:
            out[n.name] = [0.0] * len(n.strategies)
        else:
            out[n.name] = [costs.op_cost(n.call.target, s.inputs, s.outputs).compute_s for s in n.strategies]
    return out


def node_memory(graph: AnnotatedGraph, costs: CostModel, options: Options) -> dict[str, list[int]]:
    return {n.name: [node_bytes(n.kind, n.call.target if n.call else None, s.outputs, graph.mesh.shape,
                                costs.training, options.optimizer_state_bytes) for s in n.strategies]
            for n in graph.nodes}


# ---- 1. groups ---------------------------------------------------------------------

def build_groups(graph: AnnotatedGraph, pricer: EdgePricer, ncost: dict[str, list[float]],
                 follow: bool, store_as_read: bool = True,
                 block_of: Optional[dict[str, tuple[str, int]]] = None) -> dict[str, Member]:
    """`block_of` (node -> repeated block): groups never span two blocks, so identical
    blocks have identical groups and can share variables (passes/clusters.py)."""
    block_of = block_of or {}
    groups: dict[str, Member] = {}
    for n in graph.nodes:
        groups[n.name] = _forward_member(n, graph, groups, follow, block_of)
    if follow and store_as_read:
        uses: dict[str, list[tuple[str, int]]] = {}
        for n in graph.nodes:
            for pos, (u, _) in enumerate(n.inputs):
                uses.setdefault(u, []).append((n.name, pos))
        for n in graph.nodes:
            if n.kind.is_input and len(n.strategies) > 1 and len(uses.get(n.name, ())) == 1:
                consumer = uses[n.name][0][0]
                if block_of.get(consumer) == block_of.get(n.name):
                    groups[n.name] = _backward_member(n, *uses[n.name][0], graph, groups, pricer)
    return groups


def _identity(n: PlannedNode) -> Member:
    return Member(n.name, tuple(range(len(n.strategies))))


def _forward_member(n: PlannedNode, graph: AnnotatedGraph, groups: dict[str, Member], follow: bool,
                    block_of: dict[str, tuple[str, int]]) -> Member:
    """A single-input op whose layout is fixed by its producer's (exactly one strategy
    reads the producer's output as it is, for every producer choice) joins its group."""
    is_getitem = n.kind is NodeKind.GETITEM
    if not (is_getitem or (follow and len(n.inputs) == 1 and n.call is not None)):
        return _identity(n)
    u, k = n.inputs[0]
    producer = graph.node(u)
    if producer.kind.is_input and not is_getitem:
        return _identity(n)
    if block_of.get(u) != block_of.get(n.name):
        return _identity(n)
    lead = groups[u]
    index = []
    for pi in lead.index_map:
        if pi < 0:
            index.append(-1)
            continue
        src = producer.strategies[pi].outputs[k]
        exact = [j for j, s in enumerate(n.strategies) if s.inputs[0] == src]
        if is_getitem and exact:
            index.append(exact[0])
        elif len(exact) == 1:
            index.append(exact[0])
        else:
            # the layout this op produces is a real choice here (or needs a reshard):
            # leave it to the ILP rather than guess greedily
            return _identity(n)
    return Member(lead.leader, tuple(index))


def _backward_member(p: PlannedNode, consumer: str, position: int, graph: AnnotatedGraph,
                     groups: dict[str, Member], pricer: EdgePricer) -> Member:
    v = graph.node(consumer)
    lead = groups[consumer]
    index = []
    for vi in lead.index_map:
        if vi < 0:
            index.append(-1)
            continue
        wanted = v.strategies[vi].inputs[position]
        exact = [j for j, s in enumerate(p.strategies) if s.outputs[0] == wanted]
        if exact:  # stored as read: no reshard, and the least memory
            index.append(exact[0])
            continue
        costs = [pricer.cost_s(s.outputs[0], v.strategies[vi], position) for s in p.strategies]
        best = min(costs)
        index.append(costs.index(best) if best < INF else -1)
    return Member(lead.leader, tuple(index))


# ---- 2. the ILP --------------------------------------------------------------------

@dataclass
class _Ilp:
    prob: pulp.LpProblem
    choice: dict[str, list[Optional[pulp.LpVariable]]]
    n_vars: int


def build_ilp(graph: AnnotatedGraph, groups: dict[str, Member], pricer: EdgePricer,
              ncost: dict[str, list[float]], memory: dict[str, list[int]], budget: Optional[int],
              minimise_memory: bool = False, rep: Optional[dict[str, str]] = None) -> _Ilp:
    """`rep` (node -> representative, passes/clusters.py): a leader whose representative
    is another node reuses that node's variables; its costs are still added."""
    rep = rep or {}
    leaders = [n for n in graph.nodes if groups[n.name].leader == n.name]
    gcost = {L.name: [0.0] * len(L.strategies) for L in leaders}
    gmem = {L.name: [0] * len(L.strategies) for L in leaders}
    # group cost: members' compute; group memory: members' bytes
    for n in graph.nodes:
        m = groups[n.name]
        for i, j in enumerate(m.index_map):
            gcost[m.leader][i] += INF if j < 0 else ncost[n.name][j]
            gmem[m.leader][i] += 0 if j < 0 else memory[n.name][j]
    inter: list[tuple[PlannedNode, int, str, int]] = []
    for v in graph.nodes:
        mv = groups[v.name]
        for pos, (u, k) in enumerate(v.inputs):
            mu = groups[u]
            if mu.leader != mv.leader:
                inter.append((v, pos, u, k))
                continue
            producer = graph.node(u)
            for i, (ui, vi) in enumerate(zip(mu.index_map, mv.index_map)):
                if ui >= 0 and vi >= 0:
                    gcost[mv.leader][i] += pricer.cost_s(producer.strategies[ui].outputs[k], v.strategies[vi], pos)
    prob = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
    objective = Objective()
    choice: dict[str, list[Optional[pulp.LpVariable]]] = {}
    n_vars = 0
    # one-hot: sum_i s[g,i] = 1
    for L in sorted(leaders, key=lambda L: rep.get(L.name, L.name) != L.name):  # representatives first
        twin = rep.get(L.name, L.name)
        if twin != L.name:
            vars_ = choice[twin]
            for i, var in enumerate(vars_):
                if var is not None:
                    objective.add(var, gmem[L.name][i] / 2**20 if minimise_memory else gcost[L.name][i] * US)
            choice[L.name] = vars_
            continue
        vars_: list[Optional[pulp.LpVariable]] = []
        for i, c in enumerate(gcost[L.name]):
            if c == INF:
                vars_.append(None)
                continue
            var = _variable(prob, f"s_{L.name}_{i}", cat="Binary")
            objective.add(var, gmem[L.name][i] / 2**20 if minimise_memory else c * US)
            vars_.append(var)
            n_vars += 1
        if not any(v is not None for v in vars_):
            raise SolverError(f"node {L.name} ({L.op}) has no feasible strategy on mesh {graph.mesh.shape}: "
                              "every choice needs a reshard autopar cannot do")
        prob += pulp.lpSum(v for v in vars_ if v is not None) == 1, f"onehot_{L.name}"
        choice[L.name] = vars_
    # memory: sum_g sum_i mem[g,i] s[g,i] <= budget
    if budget is not None and not minimise_memory:
        prob += pulp.lpSum(gmem[g][i] * v for g, vars_ in choice.items() for i, v in enumerate(vars_)
                           if v is not None) <= budget, "memory_budget"
    # edges between groups; an edge whose endpoints have the same representatives as an
    # earlier one has its variables and cost terms: add those terms once more
    built: dict[tuple, Objective] = {}
    for e, (v, pos, u, k) in enumerate(inter):
        key = (rep.get(v.name, v.name), pos, rep.get(u, u), k)
        if key not in built:
            built[key] = Objective()
            n_vars += _edge_terms(prob, built[key], e, graph, groups, choice, pricer, v, pos, u, k)
        if not minimise_memory:
            objective.extend(built[key])
    prob += objective.expression()
    return _Ilp(prob, choice, n_vars)


def _classes(member: Member, var_list: list, key) -> dict:
    out: dict = {}
    for i, j in enumerate(member.index_map):
        if j >= 0 and var_list[i] is not None:
            out.setdefault(key(j), []).append(var_list[i])
    return out


class Objective:
    """Linear terms accumulated per variable (PuLP's operator overloading is slow at 10^5 terms)."""

    def __init__(self) -> None:
        self.coef: dict = {}
        self.constant = 0.0

    def add(self, var: Optional[pulp.LpVariable], c: float) -> None:
        if var is None:
            self.constant += c
        elif c:
            self.coef[var] = self.coef.get(var, 0.0) + c

    def extend(self, other: "Objective") -> None:
        self.constant += other.constant
        for var, c in other.coef.items():
            self.coef[var] = self.coef.get(var, 0.0) + c

    def expression(self) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression(self.coef, constant=self.constant)


def _edge_terms(prob, objective: Objective, e, graph, groups, choice, pricer, v: PlannedNode, pos: int, u: str,
                k: int) -> int:
    """Adds edge e's constraints and its reshard cost terms to `objective`; returns how
    many variables it created."""
    producer = graph.node(u)
    mu, mv = groups[u], groups[v.name]
    src = _classes(mu, choice[mu.leader], lambda j: producer.strategies[j].outputs[k])
    # consumer strategies with the same input spec and grad-sync axes price alike
    merged: dict = {}
    for i, j in enumerate(mv.index_map):
        var = choice[mv.leader][i]
        if j >= 0 and var is not None:
            strat = v.strategies[j]
            merged.setdefault((strat.inputs[pos], grad_sync_axes(strat, pos)), (strat, []))[1].append(var)
    dst_classes = list(merged.values())
    matrix = {(o, r): pricer.cost_s(o, dst_classes[r][0], pos) for o in src for r in range(len(dst_classes))}
    if len(set(matrix.values())) == 1 and INF not in matrix.values():
        objective.add(None, next(iter(matrix.values())) * US)
        return 0
    if len(src) == 1:
        (o,) = src
        for r, (_, vars_) in enumerate(dst_classes):
            for var in vars_:
                _add_or_forbid(prob, objective, var, matrix[(o, r)], f"e{e}_d{r}")
        return 0
    if len(dst_classes) == 1:
        for i, (o, vars_) in enumerate(src.items()):
            for var in vars_:
                _add_or_forbid(prob, objective, var, matrix[(o, 0)], f"e{e}_s{i}")
        return 0
    xs: dict = {}
    for oi, o in enumerate(src):
        for r in range(len(dst_classes)):
            if matrix[(o, r)] < INF:
                xs[(oi, r)] = x = _variable(prob, f"x_{e}_{oi}_{r}", lowBound=0)
                objective.add(x, matrix[(o, r)] * US)
    for oi, (o, vars_) in enumerate(src.items()):
        prob += pulp.lpSum(x for (a, _), x in xs.items() if a == oi) == pulp.lpSum(vars_), f"e{e}_src{oi}"
    for r, (_, vars_) in enumerate(dst_classes):
        prob += pulp.lpSum(x for (_, b), x in xs.items() if b == r) == pulp.lpSum(vars_), f"e{e}_dst{r}"
    return len(xs)


def _variable(prob: pulp.LpProblem, name: str, **kw) -> pulp.LpVariable:
    """PuLP 3.3 deprecates free-standing LpVariable in favour of prob.add_variable."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, **kw)
    return pulp.LpVariable(name, **kw)


def _add_or_forbid(prob, objective: Objective, var, cost: float, name: str) -> None:
    if cost == INF:
        prob += var == 0, f"forbid_{name}_{var.name}"
    else:
        objective.add(var, cost * US)


# ---- 3. solve and read back ---------------------------------------------------------

def solve(graph: AnnotatedGraph, costs: CostModel, options: Options) -> Plan:
    pricer = EdgePricer(costs)
    ncost = node_costs(graph, costs)
    memory = node_memory(graph, costs, options)
    budget = options.memory_budget_bytes
    # under a budget a parameter may be stored sharded and gathered at use (FSDP), so it
    # does not simply take the layout its consumer reads
    mode = cluster_mode(options.cluster_layers)
    block_of = find_blocks(graph) if mode else {}
    groups = build_groups(graph, pricer, ncost, options.follow, store_as_read=budget is None, block_of=block_of)
    blocks = cluster(graph, block_of, groups, mode or "inner")
    if block_of and not blocks.shared_blocks:  # nothing to share: keep followers free to cross blocks
        groups = build_groups(graph, pricer, ncost, options.follow, store_as_read=budget is None)
    ilp = build_ilp(graph, groups, pricer, ncost, memory, budget, rep=blocks.rep)
    name, solver = solver_for(options)
    t0 = time.perf_counter()
    with quiet_stdout():
        ilp.prob.solve(solver)
    elapsed = time.perf_counter() - t0
    status = pulp.LpStatus[ilp.prob.status]
    if status == "Infeasible" and budget is not None:
        raise MemoryBudgetError(budget, _smallest_footprint(graph, groups, pricer, ncost, memory, options,
                                                            blocks.rep))
    picks = _picks(ilp, name, status, elapsed, options)
    if status != "Optimal":
        status = f"{status} (time limit {options.time_limit_s} s)"
    objective_s = (pulp.value(ilp.prob.objective) or 0.0) / US
    report = SolverReport(name, status, objective_s, gap(ilp.prob), elapsed, ilp.n_vars,
                          ilp.prob.numConstraints(), len({id(v) for v in ilp.choice.values()}),
                          blocks.shared_blocks)
    return read_plan(graph, groups, picks, pricer, costs, report, memory)


def cluster_mode(value) -> Optional[str]:
    if value is True:
        return "inner"
    if value in (False, None, "off"):
        return None
    if value in MODES:
        return value
    raise ValueError(f"Options.cluster_layers={value!r}: use 'inner' (default), 'all', or 'off'/False")


def _smallest_footprint(graph, groups, pricer, ncost, memory, options: Options, rep: dict[str, str]) -> int:
    ilp = build_ilp(graph, groups, pricer, ncost, memory, None, minimise_memory=True, rep=rep)
    with quiet_stdout():
        ilp.prob.solve(solver_for(options)[1])
    picks = _picks(ilp, "memory", pulp.LpStatus[ilp.prob.status], 0.0, options)
    return sum(memory[n.name][groups[n.name].index_map[picks[groups[n.name].leader]]] for n in graph.nodes)


def _picks(ilp: _Ilp, name: str, status: str, elapsed: float, options: Options) -> dict[str, int]:
    picks = {}
    for leader, vars_ in ilp.choice.items():
        vals = [(v.value() or 0.0) if v is not None else 0.0 for v in vars_]
        best = max(range(len(vals)), key=lambda i: vals[i])
        if vals[best] < 0.5:
            raise SolverError(f"the {name} solver returned {status} without a choice for node {leader} "
                              f"after {elapsed:.1f} s; raise Options.time_limit_s or set Options.follow=True")
        picks[leader] = best
    return picks


def _alternative(n: PlannedNode, alt: Strategy, chosen: dict[str, Strategy],
                 consumers: dict[str, list[tuple[PlannedNode, int, int]]], pricer: EdgePricer,
                 costs: CostModel) -> Alternative:
    compute_s = costs.op_cost(n.call.target, alt.inputs, alt.outputs).compute_s if n.call is not None else 0.0
    into = sum(pricer.cost_s(chosen[u].outputs[k], alt, pos) for pos, (u, k) in enumerate(n.inputs))
    out_of = sum(pricer.cost_s(alt.outputs[k], chosen[v.name], pos) for v, pos, k in consumers.get(n.name, ()))
    return Alternative(alt.inputs, alt.outputs, compute_s, into, out_of)


def read_plan(graph: AnnotatedGraph, groups: dict[str, Member], picks: dict[str, int], pricer: EdgePricer,
              costs: CostModel, report: SolverReport, memory: dict[str, list[int]]) -> Plan:
    chosen: dict[str, Strategy] = {}
    for n in graph.nodes:
        m = groups[n.name]
        chosen[n.name] = n.strategies[m.index_map[picks[m.leader]]]
    nodes, edges = [], []
    compute_total = comm_total = 0.0
    param_bytes = act_bytes = state_bytes = 0
    mesh = graph.mesh.shape
    consumers: dict[str, list[tuple[PlannedNode, int, int]]] = {}
    for n in graph.nodes:
        for pos, (u, k) in enumerate(n.inputs):
            consumers.setdefault(u, []).append((n, pos, k))
    for n in graph.nodes:
        s = chosen[n.name]
        c = costs.op_cost(n.call.target, s.inputs, s.outputs).compute_s if n.call is not None else 0.0
        compute_total += c
        options = tuple(_alternative(n, alt, chosen, consumers, pricer, costs) for alt in n.strategies)
        nodes.append(NodeChoice(n.name, n.op, s.inputs, s.outputs, c, len(n.strategies), n.module, options,
                                groups[n.name].leader, n.kind))
        nbytes = memory[n.name][groups[n.name].index_map[picks[groups[n.name].leader]]]
        if n.kind.is_state or n.kind is NodeKind.CONSTANT:
            param_bytes += s.outputs[0].local_nbytes(mesh)
            state_bytes += nbytes - s.outputs[0].local_nbytes(mesh)
        else:
            act_bytes += nbytes
        for pos, (u, k) in enumerate(n.inputs):
            steps = pricer.steps(chosen[u].outputs[k], s, pos)
            assert steps is not None, f"solver picked an unreachable reshard {u} -> {n.name}"
            comm = costs.steps_cost(steps).total_s
            comm_total += comm
            edges.append(EdgePlan(u, k, n.name, pos, steps, comm))
    return Plan(graph.mesh, graph.traced.model_name, graph.traced.fingerprint, costs.training, costs.device.name,
                tuple(nodes), tuple(edges), compute_total, comm_total, param_bytes, act_bytes, report,
                graph.unruled_ops, state_bytes, discovered_ops=graph.discovered_ops)
