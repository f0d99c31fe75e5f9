"""Pipeline stages chosen by the planner (Alpa's inter-operator pass over layer clusters).

    traced graph at microbatch size + mesh + pipeline axis  ->  Plan with .pipeline

1. The sub-mesh is the mesh without the pipeline axis; the intra-op ILP (passes/solve/solve.py)
   plans the whole graph at microbatch size on it, once per sub-mesh shape (memoised:
   every axis of a (2, 2, 2) mesh leaves the same (2, 2) sub-mesh).
2. The repeated blocks (passes/clusters.find_blocks; the container with the most) are the
   units a stage is made of. Each node's price in that plan (its compute and the reshards
   into it) goes to its unit: a block, or the part before the blocks (stage 0) or after
   them (last stage). With clustered twin blocks the ILP picks alike for every inner
   block, so a block's price does not depend on which stage holds it.
3. Each boundary after block j carries the activations produced at or before j and read
   after it (full microbatch tensors: a stage's program returns full outputs), priced as a
   point-to-point send on the pipeline axis's link: alpha + bytes * beta, twice in
   training (the gradient comes back).
4. Dynamic programming over contiguous block ranges: for n stages,
       F[k][j] = min_i max(F[k-1][i], cost(i, j)),   cost(i, j) = sum of units i..j-1 (+ the
       part before the blocks if i = 0, + the part after if j = L) + send after j-1 (j < L)
   minimises the slowest stage (balance). Under Options.memory_budget_bytes only ranges
   whose stage fits are allowed (passes/plan/pipeline_split.py: parameters + state + the
   activations of its microbatches in flight); PipelineMemoryError names the smallest
   heaviest rank when no split fits. The step then takes
       T = M * (slowest rank's load per microbatch) + (S - 1) * (slowest stage)
   (the second term is the bubble: (S-1)/M of a stage step per microbatch; interleaved
   schedules hold v chunks per rank, so the bubble shrinks by v).
5. pipeline_axis="auto": every axis of size > 1 whose stages fit the blocks is tried
   against the plain ILP over the whole mesh at the full batch; the cheapest wins (ties:
   the plain plan, then the lower axis). Under a budget a candidate that does not fit
   drops out, so a pipeline that fits wins over a plain plan that does not.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from autopar import _compat
from autopar.core.kinds import NodeKind
from autopar.core.links import link_overrides
from autopar.core.mesh import Mesh
from autopar.core.options import MEMORY_AUTO, CostSource, Options
from autopar.core.errors import MemoryBudgetError
from autopar.core.pipeline import (PipelineAxis, PipelineError, PipelineMemoryError, PipelinePlan, Schedule, Stage,
                                   check_microbatches, check_request, stage_mesh)
from autopar.core.plan import Plan
from autopar.cost_models.devices import memory_budget, preset
from autopar.cost_models.model import CostModel
from autopar.passes.strategies.clusters import find_blocks
from autopar.passes.plan.pipeline_split import (MemoryBound, Units, in_flight, rank_bytes, smallest_split,
                                         split_stages)
from autopar.passes.plan.pipeline_stages import stage_plans
from autopar.passes.plan.planning import plan_annotated, plan_traced, trace_for_planning
from autopar.passes.strategies.strategies import AnnotatedGraph, annotate
from autopar.passes.trace.trace import TracedGraph



# ---- 0. inputs and meshes ----------------------------------------------------------

def microbatch_inputs(args: tuple, kwargs: dict, microbatches: int) -> tuple[tuple, dict]:
    """One microbatch of the inputs: dim 0 of every tensor leaf divided by `microbatches`."""
    leaves, tree = _compat.tree_flatten((tuple(args), dict(kwargs)))
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            batch = x.shape[0] if x.ndim else 1
            if x.ndim == 0 or batch % microbatches:
                raise PipelineError(f"microbatches={microbatches} does not divide the batch of input tensor #{i} "
                                    f"(shape {tuple(x.shape)}): pick microbatches that divide {batch}, or a batch "
                                    f"that is a multiple of {microbatches}")
            x = x[: batch // microbatches]
        out.append(x)
    return _compat.tree_unflatten(out, tree)


# ---- 1-3. prices of the units --------------------------------------------------------

def units_of(graph: AnnotatedGraph, plan: Plan) -> Units:
    """Step 2 and 3: each node's price in `plan` assigned to its block, or before/after."""
    container, position = _positions(graph)
    blocks = max(position.values()) if position else 0
    price = {n.name: n.compute_s for n in plan.nodes}
    for e in plan.edges:
        price[e.consumer] = price.get(e.consumer, 0.0) + e.comm_s
    block_s = [0.0] * blocks
    before_s = after_s = 0.0
    for n in graph.nodes:
        p = position[n.name]
        if p < 0:
            before_s += price[n.name]
        elif p >= blocks:
            after_s += price[n.name]
        else:
            block_s[p] += price[n.name]
    return Units(container, tuple(block_s), before_s, after_s, _boundary_bytes(graph, position, blocks),
                 *_unit_bytes(plan, position, blocks))


def _unit_bytes(sub: Plan, position: dict[str, int], blocks: int
                ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Each block's (parameter, gradient + optimiser state, activation) bytes per rank in
    the sub-mesh plan; what comes before the blocks counts with block 0 and what comes
    after with the last (their stages hold them). Activations are op outputs for one
    microbatch (an upper bound, as Plan.activation_bytes); the state is the sub-mesh
    plan's, shared out in proportion to parameter bytes."""
    params, acts = [0] * blocks, [0] * blocks
    for n in sub.nodes:
        p = min(max(position[n.name], 0), blocks - 1)
        if n.kind.is_state:
            params[p] += n.outputs[0].local_nbytes(sub.mesh.shape)
        elif n.kind is NodeKind.OP:
            acts[p] += sum(o.local_nbytes(sub.mesh.shape) for o in n.outputs)
    state = [sub.state_bytes * b // max(sub.param_bytes, 1) for b in params]
    return tuple(params), tuple(state), tuple(acts)


def _positions(graph: AnnotatedGraph) -> tuple[str, dict[str, int]]:
    """The block container with the most blocks, and each node's place: its block's rank
    among them, -1 before the first block, len(blocks) after the last."""
    block_of = find_blocks(graph)
    counts: dict[str, set[int]] = {}
    for container, index in block_of.values():
        counts.setdefault(container, set()).add(index)
    if not counts:
        raise PipelineError(f"model {graph.traced.model_name} has no repeated blocks (a ModuleList of layers such "
                            "as transformer.h.0, transformer.h.1, ...) to split into pipeline stages; plan it "
                            "without pipeline_axis")
    container = min(counts, key=lambda c: (-len(counts[c]), c))
    order = {index: rank for rank, index in enumerate(sorted(counts[container]))}
    inside = [i for i, n in enumerate(graph.nodes)
              if not n.kind.is_input and block_of.get(n.name, ("", 0))[0] == container]
    first, last, blocks = inside[0], inside[-1], len(order)
    position, current = {}, -1
    for i, n in enumerate(graph.nodes):
        key = block_of.get(n.name)
        if key is not None and key[0] == container:
            position[n.name] = order[key[1]]
            if not n.kind.is_input:  # a block's parameters come first, before any op
                current = position[n.name]
        elif n.kind.is_input:  # graph inputs come first; a parameter lives with its reader
            position[n.name] = -1
        else:  # nodes between blocks go with the block before them
            position[n.name] = -1 if i < first else (blocks if i > last else current)
    return container, position


def _boundary_bytes(graph: AnnotatedGraph, position: dict[str, int], blocks: int) -> tuple[int, ...]:
    """Bytes of the values made at or before block j and read after it, per boundary j."""
    crossing = [0] * max(blocks - 1, 0)
    last_use: dict[str, int] = {}
    for v in graph.nodes:
        for u, _ in v.inputs:
            last_use[u] = max(last_use.get(u, -1), position[v.name])
    for n in graph.nodes:
        if n.kind.is_state or n.kind is NodeKind.CONSTANT or not n.strategies or n.name not in last_use:
            continue
        nbytes = sum(o.meta.nbytes for o in n.strategies[0].outputs)
        for j in range(max(position[n.name], 0), min(last_use[n.name], blocks - 1)):
            crossing[j] += nbytes
    return tuple(crossing)


# ---- 4. the stage DP ---------------------------------------------------------------

def stage_values(units: Units, send_s: tuple[float, ...], send_bytes: tuple[int, ...],
                 ranges: tuple[tuple[int, int], ...], ranks: int) -> tuple[Stage, ...]:
    blocks = len(units.block_s)
    out = []
    for k, (i, j) in enumerate(ranges):
        step = sum(units.block_s[i:j]) + (units.before_s if i == 0 else 0.0) + (units.after_s if j == blocks else 0.0)
        last = j == blocks
        out.append(Stage(k, k % ranks, i, j, step, 0 if last else send_bytes[j - 1], 0.0 if last else send_s[j - 1]))
    return tuple(out)


def step_time(stages: tuple[Stage, ...], ranks: int, microbatches: int) -> tuple[float, float]:
    """(step seconds, bubble seconds): T = M * max rank load + (S - 1) * max stage (step 4)."""
    slowest = max(s.step_s + s.send_s for s in stages)
    load = [0.0] * ranks
    for s in stages:
        load[s.rank] += s.step_s + s.send_s
    bubble = (ranks - 1) * slowest
    return microbatches * max(load) + bubble, bubble


# ---- 5. plans ----------------------------------------------------------------------

class SubMeshSolves:
    """The intra-op plan of the microbatch graph per sub-mesh shape, solved once each."""

    def __init__(self, traced: TracedGraph, options: Options) -> None:
        self.traced, self.options = traced, options
        self._done: dict[tuple[int, ...], tuple[AnnotatedGraph, Plan]] = {}

    def __call__(self, mesh: Mesh, axis: int) -> tuple[AnnotatedGraph, Plan]:
        sub = stage_mesh(mesh, axis)
        options = _stage_options(self.options, mesh, axis)
        key = (sub.shape, options.nodes)
        if key not in self._done:
            graph = annotate(self.traced, sub, None, options.discover_rules)
            self._done[key] = (graph, plan_annotated(graph, options))
        return self._done[key]


def _budget(options: Options) -> "int | None":
    """Options.memory_budget_bytes as bytes ("auto": from the detected device, none for a
    saved profile's plan, as passes/solve/solve.py has it)."""
    if options.cost_model is CostSource.SAVED and options.memory_budget_bytes == MEMORY_AUTO:
        return None
    device = preset(options.device) if isinstance(options.device, str) else options.device
    return memory_budget(options.memory_budget_bytes, device)


def _stage_options(options: Options, mesh: Mesh, axis: int) -> Options:
    """Options for the sub-mesh solve, with the node count that gives each remaining axis
    the link kind (intra- or inter-node) it has in the whole mesh on Options.nodes nodes
    (the smallest such count; one node if none does). The sub-mesh plan is solved without
    the memory budget: it covers the whole graph, more than any one stage holds; the budget
    bounds the stage split instead (_fitting_split)."""
    sub = stage_mesh(mesh, axis)
    want = tuple(k for a, k in enumerate(mesh.link_kinds(options.nodes)) if a != axis) or sub.link_kinds(1)
    for nodes in range(1, sub.size + 1):
        if sub.size % nodes == 0 and sub.link_kinds(nodes) == want:
            return replace(options, nodes=nodes, memory_budget_bytes=None)
    return replace(options, nodes=1, memory_budget_bytes=None)


def pipelined_plan(full: TracedGraph, solves: SubMeshSolves, mesh: Mesh, axis: int, options: Options) -> Plan:
    """The best pipelined plan with `axis` as the pipeline axis (steps 1-4)."""
    schedule, microbatches = Schedule.of(options.pipeline_schedule), options.microbatches
    check_request(mesh.shape, axis, microbatches)
    ranks = mesh.shape[axis]
    graph, sub = solves(mesh, axis)
    units = units_of(graph, sub)
    n_stages = ranks * schedule.chunks_per_rank
    if n_stages > len(units.block_s):
        raise PipelineError(f"pipeline axis {axis} of mesh {mesh.shape} asks for {n_stages} stages ({ranks} ranks x "
                            f"{schedule.chunks_per_rank} chunks, schedule {schedule}) but {full.model_name} has only "
                            f"{len(units.block_s)} blocks in {units.container}; pipeline over an axis of at most "
                            f"{len(units.block_s)} ranks, use schedule '1f1b', or set pipeline_axis=None")
    check_microbatches(schedule, microbatches, ranks)
    training = full.training if options.training is None else options.training
    link = CostModel.analytic(options.device, mesh.shape, training, options.nodes,
                              link_overrides(options.links)).link(axis)
    sends = tuple((link.alpha_s + b * link.beta_s_per_byte) * (2 if training else 1) for b in units.boundary_bytes)
    stages = stage_values(units, sends, units.boundary_bytes, _fitting_split(units, sends, n_stages, options), ranks)
    step_s, bubble_s = step_time(stages, ranks, microbatches)
    pipeline = PipelinePlan(axis, microbatches, schedule, units.container, len(units.block_s), stages, bubble_s, step_s)
    serial_s = sub.compute_s + sub.comm_s  # the stage prices (units_of) hide nothing: split the step so too
    comm_share = sub.comm_s / serial_s if serial_s else 0.0
    param_bytes, state_bytes, activation_bytes = rank_bytes(units, stages, schedule, microbatches)
    budget = _budget(options)
    if budget is not None and param_bytes + state_bytes + activation_bytes > budget:  # interleaved: v stages a rank
        raise PipelineMemoryError(budget, param_bytes + state_bytes + activation_bytes, n_stages,
                                  len(units.block_s), schedule.value)
    return Plan(mesh=mesh, model_name=full.model_name, fingerprint=full.fingerprint, training=training,
                device=sub.device, nodes=(), edges=(), compute_s=step_s * (1 - comm_share),
                comm_s=step_s * comm_share, param_bytes=param_bytes, activation_bytes=activation_bytes,
                solver=replace(sub.solver, objective_s=step_s), unruled_ops=sub.unruled_ops, state_bytes=state_bytes,
                cost_note=f"{sub.cost_note}; stages priced on sub-mesh {stage_mesh(mesh, axis).shape} at "
                          "microbatch size", discovered_ops=sub.discovered_ops, pipeline=pipeline)


def _fitting_split(units: Units, sends: tuple[float, ...], n_stages: int, options: Options
                   ) -> tuple[tuple[int, int], ...]:
    """The fastest split within Options.memory_budget_bytes (step 4 under the budget);
    PipelineMemoryError with the smallest heaviest rank when none fits. Interleaved: when
    no split keeps every stage under budget / v, the split with the lightest heaviest stage
    is taken if its ranks fit (not the fastest such split, which the DP cannot see)."""
    schedule, budget = Schedule.of(options.pipeline_schedule), _budget(options)
    bound = None if budget is None else MemoryBound(budget, schedule, options.microbatches)
    ranges = split_stages(units, sends, n_stages, bound)
    if ranges is not None:
        return ranges
    assert bound is not None  # without a bound every split is allowed
    ranks = n_stages // schedule.chunks_per_rank
    lightest = smallest_split(units, n_stages, bound)
    smallest = stage_values(units, sends, units.boundary_bytes, lightest, ranks)
    heaviest = sum(rank_bytes(units, smallest, schedule, options.microbatches))
    if heaviest <= budget:  # interleaved: a stage over budget / v, but its rank's sum fits
        return lightest
    raise PipelineMemoryError(budget, heaviest, n_stages, len(units.block_s), schedule.value)


def plan_model(model: torch.nn.Module, args: tuple, kwargs: dict, mesh: Mesh, options: Options) -> Plan:
    """autopar.plan with Options.pipeline_axis set: trace at the full batch and at one
    microbatch, choose_plan, and for a pipelined plan every stage's own plan
    (passes/plan/pipeline_stages.py)."""
    check_request(mesh.shape, options.pipeline_axis, options.microbatches)
    micro_args, micro_kwargs = microbatch_inputs(args, kwargs, options.microbatches)
    full = trace_for_planning(model, args, kwargs, options.param_dtype)
    micro = trace_for_planning(model, micro_args, micro_kwargs, options.param_dtype)
    plan = choose_plan(full, micro, mesh, options, lambda: plan_traced(full, mesh, options)[1])
    if plan.pipeline is None or options.cost_model is CostSource.PROFILE:  # a profile times each stage where it runs
        return plan
    return replace(plan, stage_plans=stage_plans(model, micro_args, micro_kwargs, plan, options))


def choose_plan(full: TracedGraph, micro: TracedGraph, mesh: Mesh, options: Options, plain: Any) -> Plan:
    """Options.pipeline_axis: an axis (that axis pipelines) or "auto" (step 5). `plain` is
    a function of no arguments returning the unpipelined plan (solved only for "auto")."""
    axis = options.pipeline_axis
    solves = SubMeshSolves(micro, options)
    if axis is not PipelineAxis.AUTO:
        return pipelined_plan(full, solves, mesh, axis, options)
    best, refused = None, []  # under a budget, a pipeline that fits beats a plain plan that does not
    try:
        best = plain()
    except MemoryBudgetError as e:
        refused.append(e)
    for a, size in enumerate(mesh.shape):
        if size == 1:
            continue
        try:
            candidate = pipelined_plan(full, solves, mesh, a, options)
        except MemoryBudgetError as e:
            refused.append(e)
            continue
        except PipelineError:
            continue  # more stages than blocks on this axis: not a candidate
        if best is None or candidate.total_s < best.total_s:
            best = candidate
    if best is None:  # nothing fits: the error whose plan comes closest
        raise min(refused, key=lambda e: e.smallest_bytes)
    return best
