"""Pipeline stages chosen by the planner (Alpa's inter-operator pass over layer clusters).

    traced graph at microbatch size + mesh + pipeline axis  ->  Plan with .pipeline

1. The sub-mesh is the mesh without the pipeline axis; the intra-op ILP (passes/solve/solve.py)
   plans the whole graph at microbatch size on it, once per sub-mesh shape (memoised:
   every axis of a (2, 2, 2) mesh leaves the same (2, 2) sub-mesh). Where the model's
   blocks are alike, the graph is that of a sample of them, its prices stretched to the
   whole model's blocks (passes/plan/block_sample.py): a few blocks traced and solved,
   whatever the depth.
2. The repeated blocks (passes/clusters.find_blocks; the container with the most) are the
   units a stage is made of (passes/plan/pipeline_units.py). Each node's price in that plan
   (its compute and the reshards into it) and its bytes go to its unit: a block, or the part
   before the blocks (stage 0) or after them (last stage). With clustered twin blocks the ILP
   picks alike for every inner block, so a block's price does not depend on its stage.
3. Each boundary after block j carries the activations produced at or before j and read
   after it (full microbatch tensors: a stage's program returns full outputs), priced as a
   point-to-point send on the pipeline axis's link: alpha + bytes * beta, twice in
   training (the gradient comes back).
4. Dynamic programming over contiguous block ranges: for n stages,
       F[k][j] = min_i max(F[k-1][i], cost(i, j)),   cost(i, j) = sum of units i..j-1 (+ the
       part before the blocks if i = 0, + the part after if j = L) + send after j-1 (j < L)
   minimises the slowest stage (balance). Under Options.memory_budget_bytes only ranges
   whose stage fits are allowed (passes/plan/pipeline_split.py: parameters + state + the
   activations of its microbatches in flight). Where no split fits with the fastest
   layouts, the sub-mesh graph is solved again with memory priced (more parameters stored
   sharded, more blocks recomputed: a frontier of leaner plans) and each stage takes its
   fastest point that fits; PipelineMemoryError names the smallest heaviest rank when
   none does. The step then takes
       T = M * (slowest rank's load per microbatch) + (S - 1) * (slowest stage)
   (the second term is the bubble: (S-1)/M of a stage step per microbatch; interleaved
   schedules hold v chunks per rank, so the bubble shrinks by v).
5. pipeline_axis="auto": every axis of size > 1 whose stages fit the blocks is tried
   against the plain ILP over the whole mesh at the full batch; the cheapest wins (ties:
   the plain plan, then the lower axis). Under a budget a candidate that does not fit
   drops out, so a pipeline that fits wins over a plain plan that does not. Where workers
   fork (passes/plan/forked.py), the plain plan is made in one while the cheapest pipeline
   gets its stage plans (step 6) ahead of the choice, which is the same either way.
6. The chosen split's stages are traced and each solved on the sub-mesh under the budget,
   its activations counted once per microbatch in flight (stage_solve_options): parameters
   stored sharded and gathered at use, blocks recomputed, exactly as a plain plan under a
   budget. The plan's stage steps (overlapped, as solved) and its heaviest rank's bytes are
   then those plans' (with_stage_plans). Under "auto", a pipelined candidate one of whose stage graphs does
   not fit (its share of the budget, where the split's prices said it would) gives way to
   the next candidate, cheapest first; a PipelineMemoryError only when none is left.
   The stages are traced and solved side by side in forked workers (passes/plan/forked.py).
   The plan carries the fingerprint of the graph its split was priced on (block_sample.priced_trace),
   each stage plan its stage's.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

from autopar import _compat
from autopar.core.links import link_overrides
from autopar.core.mesh import Mesh
from autopar.core.options import MEMORY_AUTO, CostSource, Options
from autopar.core.errors import MemoryBudgetError
from autopar.core.pipeline import (PipelineAxis, PipelineError, PipelineMemoryError, PipelinePlan, Schedule, Stage,
                                   check_microbatches, check_request, stage_mesh)
from autopar.core.plan import Plan
from autopar.core.plan_parts import SolverReport
from autopar.cost_models.devices import memory_budget, preset
from autopar.cost_models.model import CostModel
from autopar.passes.plan import forked
from autopar.passes.plan.block_sample import UnlikeSample, priced_trace, sampled_trace, stretched
from autopar.passes.plan.pipeline_split import (MemoryBound, Units, in_flight, rank_bytes, smallest_split,
                                         split_frontier, split_stages)
from autopar.passes.plan.pipeline_stages import Pins, stage_options, stage_plans
from autopar.passes.plan.pipeline_units import lean_frontier, stage_costs, units_of
from autopar.passes.plan.planning import plan_annotated, plan_traced, trace_for_planning
from autopar.passes.strategies.strategies import AnnotatedGraph, annotate
from autopar.passes.trace.stretch import BlockSample, alike_blocks
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


# ---- 1-3. prices of the units: passes/plan/pipeline_units.py -------------------------

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
    """The intra-op plan of the microbatch graph per sub-mesh shape, solved once each, and
    under a budget its frontier of leaner plans (pipeline_units.lean_frontier), likewise.
    `sample`: the graph is that of a sample of the model's alike blocks
    (passes/plan/block_sample.py), whose Units are stretched to the whole model's."""

    def __init__(self, traced: TracedGraph, options: Options, sample: Optional[BlockSample] = None) -> None:
        self.traced, self.options, self.sample = traced, options, sample
        self._done: dict[tuple, tuple[AnnotatedGraph, Plan]] = {}
        self._frontiers: dict[tuple, tuple[Units, ...]] = {}

    def __call__(self, mesh: Mesh, axis: int) -> tuple[AnnotatedGraph, Plan]:
        sub = stage_mesh(mesh, axis)
        options = _stage_options(self.options, mesh, axis)
        key = (sub.shape, options.nodes)
        if key not in self._done:
            graph = annotate(self.traced, sub, None, options.discover_rules)
            self._done[key] = (graph, plan_annotated(graph, options))
        return self._done[key]

    def fastest(self, mesh: Mesh, axis: int) -> tuple[Units, Plan]:
        """Units of the sub-mesh plan (the whole model's), and that plan."""
        graph, sub = self(mesh, axis)
        return self._whole(units_of(graph, sub, stage_costs(_stage_options(self.options, mesh, axis), sub))), sub

    def leaner(self, mesh: Mesh, axis: int) -> tuple[Units, ...]:
        """Units of the sub-mesh plan's leaner plans (memory priced), leanest last."""
        options = _stage_options(self.options, mesh, axis)
        key = (stage_mesh(mesh, axis).shape, options.nodes)
        if key not in self._frontiers:
            graph, fastest = self(mesh, axis)
            self._frontiers[key] = tuple(self._whole(u) for u in lean_frontier(graph, fastest, options))
        return self._frontiers[key]

    def _whole(self, units: Units) -> Units:
        if self.sample is None:
            return units
        whole = stretched(units, self.sample)
        if whole is None:
            raise UnlikeSample(self.sample)
        return whole


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
    bounds the stage split (_fitting_split) and each stage's own plan (stage_solve_options).
    Its data-parallel gradients are priced once per step, as the stages reduce them."""
    sub = stage_mesh(mesh, axis)
    want = tuple(k for a, k in enumerate(mesh.link_kinds(options.nodes)) if a != axis) or sub.link_kinds(1)
    fits = [n for n in range(1, sub.size + 1) if sub.size % n == 0 and sub.link_kinds(n) == want]
    return replace(options, nodes=fits[0] if fits else 1, memory_budget_bytes=None,
                   grad_sync_every=options.microbatches)


def pipelined_plan(solves: SubMeshSolves, mesh: Mesh, axis: int, options: Options) -> Plan:
    """The best pipelined plan with `axis` as the pipeline axis (steps 1-4). It carries
    the priced graph's fingerprint (block_sample.priced_trace; what a given pipelined plan is checked
    against: runtime/stages.py)."""
    micro = solves.traced
    schedule, microbatches = Schedule.of(options.pipeline_schedule), options.microbatches
    check_request(mesh.shape, axis, microbatches)
    ranks = mesh.shape[axis]
    fastest, sub = solves.fastest(mesh, axis)
    n_stages = ranks * schedule.chunks_per_rank
    if n_stages > len(fastest.block_s):
        raise PipelineError(f"pipeline axis {axis} of mesh {mesh.shape} asks for {n_stages} stages ({ranks} ranks x "
                            f"{schedule.chunks_per_rank} chunks, schedule {schedule}) but {micro.model_name} has only "
                            f"{len(fastest.block_s)} blocks in {fastest.container}; pipeline over an axis of at most "
                            f"{len(fastest.block_s)} ranks, use schedule '1f1b', or set pipeline_axis=None")
    check_microbatches(schedule, microbatches, ranks)
    training = micro.training if options.training is None else options.training
    link = CostModel.analytic(options.device, mesh.shape, training, options.nodes,
                              link_overrides(options.links)).link(axis)
    sends = tuple((link.alpha_s + b * link.beta_s_per_byte) * (2 if training else 1)
                  for b in fastest.boundary_bytes)
    ranges, units = _fitting_split(lambda: (fastest, *solves.leaner(mesh, axis)), fastest, sends, n_stages, options)
    stages = stage_values(units, sends, units.boundary_bytes, ranges, ranks)
    step_s, bubble_s = step_time(stages, ranks, microbatches)
    pipeline = PipelinePlan(axis, microbatches, schedule, units.container, len(units.block_s), stages, bubble_s, step_s)
    serial_s = sub.compute_s + sub.comm_s  # the stage prices (units_of) hide nothing: split the step so too
    comm_share = sub.comm_s / serial_s if serial_s else 0.0
    param_bytes, state_bytes, activation_bytes = rank_bytes(units, stages, schedule, microbatches)
    budget = _budget(options)
    if budget is not None and param_bytes + state_bytes + activation_bytes > budget:  # interleaved: v stages a rank
        raise PipelineMemoryError(budget, param_bytes + state_bytes + activation_bytes, n_stages,
                                  len(units.block_s), schedule.value)
    return Plan(mesh=mesh, model_name=micro.model_name, fingerprint=micro.fingerprint, training=training,
                device=sub.device, nodes=(), edges=(), compute_s=step_s * (1 - comm_share),
                comm_s=step_s * comm_share, param_bytes=param_bytes, activation_bytes=activation_bytes,
                solver=_pipeline_report(sub.solver, step_s), unruled_ops=sub.unruled_ops, state_bytes=state_bytes,
                cost_note=f"{sub.cost_note}; stages priced on sub-mesh {stage_mesh(mesh, axis).shape} at "
                          "microbatch size", discovered_ops=sub.discovered_ops, pipeline=pipeline)


def _pipeline_report(sub: SolverReport, step_s: float) -> SolverReport:
    """The sub-mesh solve's report with the pipelined step as its objective, and no bound:
    the sub-mesh ILP's bound is on its own objective, not on the pipeline's step (the
    stage DP is exact over its prices; each stage plan reports its own gap)."""
    return replace(sub, objective_s=step_s, bound_s=None, gap=None)


def _fitting_split(frontier: Callable[[], Sequence[Units]], fastest: Units, sends: tuple[float, ...],
                   n_stages: int, options: Options) -> tuple[tuple[tuple[int, int], ...], Units]:
    """The fastest split within Options.memory_budget_bytes (step 4 under the budget) and
    the Units its stages hold: with the fastest sub-mesh plan's layouts where a split of
    those fits, else each stage at its fastest fitting point of `frontier()` (the leaner
    plans, solved only then). PipelineMemoryError with the smallest heaviest rank when
    none fits. Interleaved: when no split keeps every stage under budget / v, the split
    with the lightest heaviest stage is taken if its ranks fit (not the fastest such
    split, which the DP cannot see)."""
    schedule, budget = Schedule.of(options.pipeline_schedule), _budget(options)
    bound = None if budget is None else MemoryBound(budget, schedule, options.microbatches)
    found = split_frontier((fastest,), sends, n_stages, bound)
    if found is not None:
        return found
    assert bound is not None  # without a bound every split is allowed
    points = tuple(frontier())
    found = split_frontier(points, sends, n_stages, bound)
    if found is not None:
        return found
    ranks = n_stages // schedule.chunks_per_rank
    lightest, units = smallest_split(points, n_stages, bound)
    smallest = stage_values(units, sends, units.boundary_bytes, lightest, ranks)
    heaviest = sum(rank_bytes(units, smallest, schedule, options.microbatches))
    if heaviest <= budget:  # interleaved: a stage over budget / v, but its rank's sum fits
        return lightest, units
    raise PipelineMemoryError(budget, heaviest, n_stages, len(units.block_s), schedule.value)


def stage_solve_options(plan: Plan, options: Options) -> tuple[Options, ...]:
    """The options each stage's own plan is solved with: its sub-mesh's node count, its
    activations counted once per microbatch in flight (Options.activations_in_flight),
    and the memory budget: the whole of it where a rank holds one stage, budget / v for
    each of the v stages of a rank under interleaved 1F1B (sufficient, not necessary; what
    they leave is spent afterwards: pipeline_stages.spend_slack).
    Without a bound in bytes, Options.memory_budget_bytes as given."""
    p = plan.pipeline
    sub = _stage_options(options, plan.mesh, p.axis)
    budget = _budget(options)
    share = options.memory_budget_bytes if budget is None else budget // p.schedule.chunks_per_rank
    return tuple(replace(stage_options(sub), memory_budget_bytes=share,
                         activations_in_flight=in_flight(p.schedule, stage, len(p.stages), p.microbatches))
                 for stage in p.stages)


def with_stage_plans(plan: Plan, stages: tuple[Plan, ...], options: Options) -> Plan:
    """`plan` with its stages' own plans, and its figures taken from them: each stage's
    step (its total_s, which its plan minimised; the split's prices hide nothing) and the heaviest
    pipeline rank's bytes (each stage plan counts its microbatches in flight). A rank over
    the budget (interleaved stages, each within its share, cannot be) is refused."""
    p = plan.pipeline
    timed = tuple(replace(s, step_s=sp.total_s) for s, sp in zip(p.stages, stages))
    ranks = len({s.rank for s in timed})
    step_s, bubble_s = step_time(timed, ranks, p.microbatches)
    per_rank: dict[int, tuple[int, int, int]] = {}
    for s, sp in zip(timed, stages):
        old = per_rank.get(s.rank, (0, 0, 0))
        per_rank[s.rank] = (old[0] + sp.param_bytes, old[1] + sp.state_bytes, old[2] + sp.activation_bytes)
    params, state, acts = max(per_rank.values(), key=sum)
    budget = _budget(options)
    if budget is not None and params + state + acts > budget:
        raise PipelineMemoryError(budget, params + state + acts, len(timed), p.blocks, p.schedule.value)
    serial_s = sum(sp.total_s for sp in stages) or 1.0  # the step split as the stages' own time is
    parts = {k: step_s * sum(getattr(sp, k) for sp in stages) / serial_s for k in ("compute_s", "comm_s", "hidden_s")}
    return replace(plan, stage_plans=stages, pipeline=replace(p, stages=timed, bubble_s=bubble_s, step_s=step_s),
                   param_bytes=params, state_bytes=state, activation_bytes=acts,
                   solver=_pipeline_report(plan.solver, step_s), **parts)


def plan_model(model: torch.nn.Module, args: tuple, kwargs: dict, mesh: Mesh, options: Options,
               pins_of: Optional[Pins] = None) -> Plan:
    """autopar.plan with Options.pipeline_axis set: trace at one microbatch (and at the
    full batch for "auto", whose plain candidate needs it), the candidates of
    ranked_plans, and for a pipelined plan every stage's own plan
    (passes/plan/pipeline_stages.py) under its share of the budget, which the plan's
    figures are then taken from (with_stage_plans). Under "auto", a pipelined candidate
    whose stage graphs do not fit where the split's prices said they would gives way to
    the next candidate, cheapest first. `pins_of`: a hand plan's layouts in each stage
    (passes/plan/hand_plans.py); the split is still the one autopar's prices choose."""
    check_request(mesh.shape, options.pipeline_axis, options.microbatches)
    micro_args, micro_kwargs = microbatch_inputs(args, kwargs, options.microbatches)
    staged: dict[int, Any] = {}  # pipeline axis -> the candidate with its stage plans, or why it has none

    def with_stages(plan: Plan) -> Any:
        if plan.pipeline.axis not in staged:
            staged[plan.pipeline.axis] = forked.outcome_of(lambda: with_stage_plans(plan, stage_plans_within_budget(
                model, micro_args, micro_kwargs, plan, options, pins_of), options))
        return staged[plan.pipeline.axis]

    def plain_plan() -> Plan:
        return plan_traced(trace_for_planning(model, args, kwargs, options.param_dtype), mesh, options)[1]
    # "auto" with workers: the plain plan is made in one while the cheapest pipeline gets its stage plans
    ahead = options.pipeline_axis is PipelineAxis.AUTO and options.cost_model is not CostSource.PROFILE
    with forked.started(plain_plan) if ahead else contextlib.nullcontext(functools.cache(plain_plan)) as plain:
        def meanwhile(fits: list[Plan]) -> None:
            if ahead and fits and forked.forks():
                with_stages(min(fits, key=lambda plan: plan.total_s))
        sample = alike_blocks(model) if options.cost_model is not CostSource.PROFILE else None
        micro, sample = sampled_trace(model, micro_args, micro_kwargs, options.param_dtype, sample)
        try:
            candidates = ranked_plans(micro, mesh, options, lambda: forked.raised(plain()), sample, meanwhile)
        except UnlikeSample:
            micro = priced_trace(model, micro_args, micro_kwargs, options.param_dtype)
            candidates = ranked_plans(micro, mesh, options, lambda: forked.raised(plain()), None, meanwhile)
    refused: list[MemoryBudgetError] = []
    for plan in candidates:
        if plan.pipeline is None or options.cost_model is CostSource.PROFILE:
            return plan  # a profile times each stage where it runs
        try:
            return forked.raised(with_stages(plan))
        except PipelineMemoryError as e:
            refused.append(e)
    raise min(refused, key=lambda e: e.smallest_bytes)


def stage_plans_within_budget(model: torch.nn.Module, micro_args: tuple, micro_kwargs: dict, plan: Plan,
                              options: Options, pins_of: Optional[Pins] = None) -> tuple[Plan, ...]:
    """Every stage's own plan under its share of the budget; a PipelineMemoryError where one
    does not fit (the split's prices said it would; the stage's own graph does not)."""
    solving = stage_solve_options(plan, options)
    budget = _budget(options)
    interleaved = budget if plan.pipeline.schedule.chunks_per_rank > 1 else None
    try:
        return stage_plans(model, micro_args, micro_kwargs, plan, lambda stage: solving[stage.index], pins_of,
                           interleaved)
    except MemoryBudgetError as e:
        raise PipelineMemoryError(e.budget_bytes, e.smallest_bytes, len(plan.pipeline.stages), plan.pipeline.blocks,
                                  plan.pipeline.schedule.value) from e


def ranked_plans(micro: TracedGraph, mesh: Mesh, options: Options, plain: Any, sample: Optional[BlockSample] = None,
                 meanwhile: Callable[[list[Plan]], None] = lambda fits: None) -> list[Plan]:
    """Options.pipeline_axis: an axis (that axis pipelines: one candidate) or "auto" (step
    5: the plain plan and a pipeline on each axis longer than 1, those that fit, cheapest
    first). `plain` is a function of no arguments returning the unpipelined plan (solved
    only for "auto", after the pipelines, once meanwhile(the pipelines that fit) has run).
    A MemoryBudgetError where none fits: the one whose plan comes closest."""
    axis = options.pipeline_axis
    solves = SubMeshSolves(micro, options, sample)
    if axis is not PipelineAxis.AUTO:
        return [pipelined_plan(solves, mesh, axis, options)]
    fits, refused = [], []  # under a budget, a pipeline that fits beats a plain plan that does not
    for a, size in enumerate(mesh.shape):
        if size == 1:
            continue
        try:
            fits.append(pipelined_plan(solves, mesh, a, options))
        except MemoryBudgetError as e:
            refused.append(e)
        except PipelineError:
            continue  # more stages than blocks on this axis: not a candidate
    meanwhile(fits)
    try:
        fits.insert(0, plain())
    except MemoryBudgetError as e:
        refused.insert(0, e)
    if not fits:  # nothing fits: the error whose plan comes closest
        raise min(refused, key=lambda e: e.smallest_bytes)
    return sorted(fits, key=lambda plan: plan.total_s)  # stable: the plain plan first on a tie
