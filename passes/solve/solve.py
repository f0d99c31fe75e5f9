"""Stage 4: choose one strategy per node with an integer linear program.

    AnnotatedGraph + CostModel + Options -> Plan

1. price every node's strategies: compute seconds and bytes per rank
   (EdgePricer prices reshards on demand);
2. group the nodes: followers join their leader's group; repeated blocks share
   variables (clustering);
3. drop the choices no optimal plan needs (passes/solve/dominance.py: exact pruning), build
   the ILP over the groups (passes/solve/ilp.py, whose docstring states the model: one
   function per constraint family) and solve it for the least time within the memory
   budget; when no plan fits, solve it again for the least memory to report. A mesh of
   three axes or more starts the solver from its merged mesh's plan (passes/solve/warm_start.py),
   and an ILP of that start with very many flows is solved by column generation over them
   (passes/solve/column_generation.py);
4. read the leaders' choices back into a Plan (under a budget, each group moved to the
   smallest of its equally fast choices), with the blocks it recomputes. Where the solver
   stopped at its time limit with no plan of its own: the start when it sets every group,
   else a greedy plan (passes/solve/greedy.py), either refused when over the budget.

Recompute (passes/solve/recompute_ilp.py): in training under a budget, each repeated block
(passes/clusters.find_blocks) may drop its inner activations and run its forward again
in backward; the ILP weighs that against sharding parameters further. Without a budget
recompute only costs time, so the ILP is built without it, exactly as before.

Followers (Options.follow): a single-input op follows its producer, taking for each
producer choice its cheapest strategy; getitem follows its tuple; a placeholder used
once follows its consumer and is stored in the layout the consumer reads.

Clustering (Options.cluster_layers, passes/strategies/clusters.py): the groups of a repeated block
reuse the s variables of their twin in the first such block, and an edge whose two ends
have the same representatives as an earlier edge reuses its x variables; every copy
still adds its own cost terms, so the objective prices each block and each boundary.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from autopar.core.errors import MemoryBudgetError, SolverError
from autopar.core.kinds import NodeKind
from autopar.core.log import logged
from autopar.core.options import MEMORY_AUTO, Clustering, CostSource, Options
from autopar.core.plan import Plan
from autopar.core.plan_parts import RecomputedBlock, SolverReport
from autopar.core.placement import Spec
from autopar.cost_models.devices import budget_words, memory_budget
from autopar.cost_models.model import CostModel
from autopar.passes.strategies.clusters import Blocks, cluster, find_blocks, shared_blocks_of
from autopar.passes.solve.column_generation import solve_ilp
from autopar.passes.solve.dominance import prefer_smaller, prune_dominated
from autopar.passes.solve.greedy import greedy_picks
from autopar.passes.solve.ilp import (INF, US, EdgePricer, Ilp, IlpModel, Member, build_ilp, ilp_model,
                                memory_objective, priced_memory_objective, time_objective)
from autopar.passes.solve.ilp_overlap import graph_shares, least_backward, least_forward
from autopar.passes.solve.prices import node_costs, node_memory
from autopar.passes.solve.read_back import read_plan
from autopar.passes.solve.recompute_ilp import block_terms
from autopar.passes.solve.solver_backend import Solution, SolveStatus, solver_name
from autopar.passes.solve.warm_start import StartingLayouts, starting_picks, starting_solution
from autopar.passes.strategies.strategies import AnnotatedGraph, PlannedNode


# ---- 2. groups (1, prices: passes/solve/prices.py) ---------------------------------------------------------------------

def build_groups(graph: AnnotatedGraph, pricer: EdgePricer, follow: bool, store_as_read: bool = True,
                 block_of: Optional[dict[str, tuple[str, int]]] = None) -> dict[str, Member]:
    """`block_of` (node -> repeated block): groups never span two blocks, so identical
    blocks have identical groups and can share variables (passes/strategies/clusters.py)."""
    block_of = block_of or {}
    groups: dict[str, Member] = {}
    for n in graph.nodes:
        groups[n.name] = _forward_member(n, graph, groups, follow, block_of, pricer)
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


def _by_spec(specs: list[Spec], pricer: EdgePricer) -> dict[int, list[int]]:
    """Numbered spec -> the indices in `specs` of the specs equal to it."""
    out: dict[int, list[int]] = {}
    for j, spec in enumerate(specs):
        out.setdefault(pricer.spec_id(spec), []).append(j)
    return out


def _forward_member(n: PlannedNode, graph: AnnotatedGraph, groups: dict[str, Member], follow: bool,
                    block_of: dict[str, tuple[str, int]], pricer: EdgePricer) -> Member:
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
    reading = _by_spec([s.inputs[0] for s in n.strategies], pricer)
    index = []
    for pi in lead.index_map:
        if pi < 0:
            index.append(-1)
            continue
        exact = reading.get(pricer.spec_id(producer.strategies[pi].outputs[k]), [])
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
    stored = _by_spec([s.outputs[0] for s in p.strategies], pricer)
    index = []
    for vi in lead.index_map:
        if vi < 0:
            index.append(-1)
            continue
        exact = stored.get(pricer.spec_id(v.strategies[vi].inputs[position]), [])
        if exact:  # stored as read: no reshard, and the least memory
            index.append(exact[0])
            continue
        costs = [pricer.cost_s(s.outputs[0], v.strategies[vi], position) for s in p.strategies]
        best = min(costs)
        index.append(costs.index(best) if best < INF else -1)
    return Member(lead.leader, tuple(index))


# ---- 3. solve (4, read back: passes/solve/read_back.py)---------------------------------------------------------------------

def solve(graph: AnnotatedGraph, costs: CostModel, options: Options, start: Optional[StartingLayouts] = None,
          memory_price: float = 0.0) -> Plan:
    """The fastest plan within Options.memory_budget_bytes (MemoryBudgetError when none fits).
    `start`: layouts to hand the solver as its first plan (passes/solve/warm_start.py).
    The default budget, "auto" (the detected device's memory), binds only where the
    fastest plan without it would not fit: that plan is solved first and kept when it
    fits (the same plan as with no bound, and a smaller ILP), else the bounded one is
    solved. A saved profile's plan is for its own device: "auto" bounds it by nothing.
    `memory_price` (seconds per byte per rank, > 0): no budget; the plan minimising step
    seconds + memory_price x bytes, one point of the time-memory frontier (parameters may
    be stored sharded and blocks recomputed wherever the bytes saved pay for the time)."""
    if memory_price > 0:
        return _solve(graph, costs, replace(options, memory_budget_bytes=None), start, memory_price)
    if options.memory_budget_bytes != MEMORY_AUTO:
        return _solve(graph, costs, options, start)
    bound = None if options.cost_model is CostSource.SAVED else memory_budget(MEMORY_AUTO, costs.device)
    free = _solve(graph, costs, replace(options, memory_budget_bytes=None), start)
    if bound is None or free.memory_bytes <= bound:
        return free
    try:
        return _solve(graph, costs, replace(options, memory_budget_bytes=bound), start)
    except MemoryBudgetError as e:
        raise MemoryBudgetError(e.budget_bytes, e.smallest_bytes, budget_words(MEMORY_AUTO, costs.device)) from None


@logged("solve", lambda p: f"{p.solver.status}, {p.solver.variables} variables, "
                           f"step {p.total_s * 1e3:.3f} ms predicted")
def _solve(graph: AnnotatedGraph, costs: CostModel, options: Options, start: Optional[StartingLayouts],
           memory_price: float = 0.0) -> Plan:
    """solve() under a budget of bytes, or None (no bound); memory priced where memory_price > 0."""
    # 1. price every node's strategies
    pricer = EdgePricer(costs)
    memory = node_memory(graph, costs, options)
    # 2. groups, and the variables repeated blocks share
    budget = options.memory_budget_bytes
    lean = budget is not None or memory_price > 0  # memory counts: sharded storage and recompute are choices
    groups, blocks = _groups_and_blocks(graph, pricer, options, lean)
    compute = node_costs(graph, costs)
    forward_s = node_costs(graph, replace(costs, training=False)) if costs.training else compute
    # gradient buckets hide under backward, prefetched parameter gathers under the compute
    # between two parameter uses, activation collectives on GPU presets under the compute between
    # their two ends: each edge's shares of them (ilp_overlap.py)
    overlapped = costs.training or costs.device.collectives_beside_compute  # inference: prefetch and activations
    least = least_backward(graph, compute, forward_s) if overlapped else None  # all 0 in inference
    least_fwd = least_forward(graph, forward_s)
    shares = graph_shares(graph, least, least_fwd, options.grad_sync_every, costs) \
        if least is not None else {}
    model = ilp_model(graph, groups, pricer, compute, memory, blocks.rep, shares)
    forward = None
    if lean and costs.training:  # recompute can pay: the blocks and their terms
        forward = EdgePricer(replace(costs, training=False))
        model = replace(model, blocks=block_terms(model, find_blocks(graph), forward, forward_s, memory))
    keep = _recompute_groups(model)
    with_recompute = {"forward": forward} if model.blocks else {}  # forward prices: only where blocks may recompute
    model = prune_dominated(model, pricer, with_memory=lean, **with_recompute)
    # 3. the least time within the budget (or time + memory priced)
    objective = time_objective if memory_price <= 0 else priced_memory_objective(memory_price)
    ilp = build_ilp(model, pricer, objective, budget, forward, list_flows=start is not None)
    name = solver_name(options)
    started = starting_picks(model, ilp.variables, start) if start is not None else {}
    solution = solve_ilp(ilp.program, options, starting_solution(model, ilp, started) if started else None,
                         by_columns=budget is None)  # under a budget the master's LP grows hard (column_generation.py)
    if solution.status is SolveStatus.INFEASIBLE and budget is not None:
        raise MemoryBudgetError(budget, _smallest_footprint(model, pricer, memory, options, forward))
    # 4. read the choice back; where the solver stopped with no plan of its own, the start
    # when it sets every group, else a greedy one (warm_start.py, greedy.py)
    stopped = _stopped_picks(solution, model, started, pricer)
    picks = stopped[0] if stopped is not None else _picks(ilp, solution, name)
    if lean:  # memory counts: of equally fast layouts, the smaller
        picks = prefer_smaller(model, picks, pricer, keep)
    status = solution.status.value
    if solution.status is not SolveStatus.OPTIMAL:
        status = f"{status} (time limit {options.time_limit_s} s)" + (f": {stopped[1]}" if stopped else "")
    report = SolverReport(name, status, solution.objective / US, solution.gap, solution.seconds,
                          ilp.variables.count, ilp.program.num_rows, ilp.variables.groups, blocks.shared_blocks,
                          None if solution.bound is None else solution.bound / US,
                          _started(start, sum(model.owner(g) == g for g in started), ilp.variables.groups, name))
    plan = read_plan(graph, groups, picks, pricer, costs, report, memory, compute,
                     () if stopped else _recomputed(model, ilp, solution), least, least_fwd,
                     options.activations_in_flight, options.grad_sync_every)
    if stopped is None:
        return plan
    if budget is not None and plan.memory_bytes > budget:
        raise SolverError(f"the {name} solver returned {solution.status.value} without a plan after "
                          f"{solution.seconds:.1f} s, and {stopped[1]} needs {plan.memory_bytes / 2**20:,.0f} MiB per "
                          f"rank, over the budget of {budget / 2**20:,.0f} MiB; raise Options.time_limit_s")
    return replace(plan, solver=replace(report, objective_s=plan.total_s))


def _stopped_picks(solution: Solution, model: IlpModel, started: dict[str, int], pricer: EdgePricer
                   ) -> Optional[tuple[dict[str, int], str]]:
    """Where the solver stopped with no plan: the choices to read back instead, and what they are."""
    if solution.status is not SolveStatus.NOT_SOLVED:
        return None
    if len(started) == len(model.leaders):
        return started, "the plan started from"
    greedy = greedy_picks(model, pricer)
    return None if greedy is None else (greedy, "a greedy plan, not the solver's (passes/solve/greedy.py)")


def _started(start: Optional[StartingLayouts], set_groups: int, groups: int, solver: str) -> str:
    """SolverReport.start's words: the plan started from and how many groups it set."""
    if start is None or solver != "highs":  # CBC is given no start
        return ""
    return f"the {start.source} plan's layouts, for {set_groups} of {groups} groups"


def _recompute_groups(model: IlpModel) -> frozenset[str]:
    """The owner groups whose choices price recompute terms (a, f, or F on an edge into a
    block): prefer_smaller, which weighs only c, R and m, leaves them alone."""
    out = set()
    for block in model.blocks:
        out.update(model.owner(g) for g in block.dropped)
        for k in block.edges:
            edge = model.edges[k]
            out.update(model.owner(model.groups[end].leader) for end in (edge.producer, edge.consumer.name))
    return frozenset(out)


def _recomputed(model: IlpModel, ilp: Ilp, solution: Solution) -> tuple[RecomputedBlock, ...]:
    return tuple(RecomputedBlock(block.name, block.nodes)
                 for block, r in zip(model.blocks, ilp.variables.recompute.recomputed) if solution.values[r] > 0.5)


def _groups_and_blocks(graph: AnnotatedGraph, pricer: EdgePricer, options: Options, lean: bool
                       ) -> tuple[dict[str, Member], Blocks]:
    # where memory counts (a budget, or memory priced) a parameter may be stored sharded
    # and gathered at use (FSDP), so it does not simply take the layout its consumer reads
    store_as_read = not lean
    mode = options.cluster_layers
    block_of = shared_blocks_of(graph) if mode is not Clustering.OFF else {}
    groups = build_groups(graph, pricer, options.follow, store_as_read, block_of)
    blocks = cluster(graph, block_of, groups, mode)
    if block_of and not blocks.shared_blocks:  # nothing to share: keep followers free to cross blocks
        groups = build_groups(graph, pricer, options.follow, store_as_read)
    return groups, blocks


def _smallest_footprint(model: IlpModel, pricer: EdgePricer, memory: dict[str, list[int]],
                        options: Options, forward: Optional[EdgePricer] = None) -> int:
    """The fewest bytes per rank any plan needs: the optimum of the memory objective
    (with every block recomputed that drops bytes so)."""
    ilp = build_ilp(model, pricer, memory_objective, forward=forward)
    solution = solve_ilp(ilp.program, options)
    picks = _picks(ilp, solution, "memory")
    member = model.groups
    total = sum(memory[n.name][member[n.name].index_map[picks[member[n.name].leader]]] for n in model.graph.nodes)
    recomputed = {b.name for b in _recomputed(model, ilp, solution)}
    return total - sum(a[picks[g]] for b in model.blocks if b.name in recomputed for g, a in b.dropped.items())


def _picks(ilp: Ilp, solution: Solution, name: str) -> dict[str, int]:
    picks = {}
    for leader, vars_ in ilp.variables.s.items():
        vals = [solution.values[v] if v is not None else 0.0 for v in vars_]
        best = max(range(len(vals)), key=lambda i: vals[i])
        if vals[best] < 0.5:
            raise SolverError(f"the {name} solver returned {solution.status.value} without a choice for node "
                              f"{leader} after {solution.seconds:.1f} s; raise Options.time_limit_s or set "
                              "Options.follow=True")
        picks[leader] = best
    return picks
