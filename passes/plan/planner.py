"""Planning's entries: a traced graph (plan_graph), or a model offline (plan_model), for
whichever kind of plan the options ask for.

    traced graph, mesh, Options [, pinned layouts, local buffers, solve] -> Plan (plan_graph)
                             what every other entry plans a graph with; a ParallelModule
                             passes its own `solve` (the profiling cost model's measure ->
                             plan -> calibrate -> plan again, autopar/runtime/measured_plan.py),
                             so the planner never imports the runtime

    model, inputs, mesh, Options -> Plan
      pipeline_axis set   -> passes/plan/pipeline.py: stages chosen by the DP, every stage's plan inside
      dynamic set         -> passes/plan/dynamic_plans.py: one trace with symbolic sizes, planned at
                             the range's representative sizes
      otherwise           -> passes/plan/planning.py: trace, strategies, costs, solve
    model, step inputs, mesh, Options, local buffers -> PlanBook (plan_steps)
                             generation's decode and prefill plans, the first fixing every
                             state tensor's layout (autopar.plan_for_generation)

autopar.plan calls plan_model; on ranks the first rank calls it for a pipelined plan
(autopar/runtime/stages.py), and a ParallelModule's rank 0 calls plan_graph for each
traced graph it meets (it traces on rank 0 and ships the graph).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.plan import Plan
from autopar.core.placement import Placement
from autopar.core.plan_book import PlanBook
from autopar.passes.plan import pipeline
from autopar.passes.plan.buffer_layouts import LocalBuffers, SolveGraph, plan_local_buffers
from autopar.passes.plan.dynamic_plans import DynamicPlans, PlannedGraph
from autopar.passes.plan.planning import plan_annotated, planning_inputs, warn_over_memory
from autopar.passes.plan.state_layouts import state_owners, whole_state
from autopar.passes.strategies.strategies import annotate
from autopar.passes.trace.stretch import stretched_trace
from autopar.passes.trace.trace import TracedGraph, trace


def plan_graph(traced: TracedGraph, mesh: Mesh, options: Options,
               pinned: Optional[dict[str, tuple[Placement, ...]]] = None, local: Optional[LocalBuffers] = None,
               solve: Optional[SolveGraph] = None, coarse: Optional[Plan] = None) -> Plan:
    """`pinned`: layouts the plan must keep (a later plan of a module's shards); `local`:
    buffers each rank keeps its block of, whose layout is chosen among candidates
    (passes/plan/buffer_layouts.py); `coarse`: the plan of `mesh` with two axes merged,
    where the caller has it (plan_annotated starts the solver from it)."""
    solve = solve or (lambda graph: plan_annotated(graph, options, coarse=coarse))
    if local is not None:
        plan = plan_local_buffers(traced, mesh, options, pinned, local, solve)
    else:
        plan = solve(annotate(traced, mesh, pinned, options.discover_rules))
    warn_over_memory(plan, options)
    return plan


def plan_model(model: nn.Module, args: Any, kwargs: Optional[dict], mesh: Mesh, options: Options) -> Plan:
    mesh.ranks_per_node(options.nodes)  # a node count that does not divide the mesh fails before tracing
    args, kwargs = planning_inputs(model, args, kwargs)
    if options.pipeline_axis is not None:
        plan = pipeline.plan_model(model, args, kwargs, mesh, options)
        warn_over_memory(plan, options)
        return plan
    if options.dynamic is not None:
        return _dynamic(model, args, kwargs, mesh, options)
    return plan_graph(stretched_trace(model, args, kwargs, options.param_dtype), mesh, options)


def _dynamic(model: nn.Module, args: tuple, kwargs: dict, mesh: Mesh, options: Options) -> Plan:
    """The plan a dynamic ParallelModule would make at its first call with these inputs
    (the same graph fingerprint, so compile(..., plan=it, dynamic=the same) runs it)."""
    def traced_plan(a: tuple, kw: dict, shapes: tuple) -> PlannedGraph:
        traced = trace(model, *planning_inputs(model, a, kw), options.param_dtype, shapes)
        return PlannedGraph(traced, plan_graph(traced, mesh, options))
    return DynamicPlans(options.dynamic, traced_plan).compiled(args, kwargs).plan


def plan_steps(model: nn.Module, steps: tuple[tuple, ...], mesh: Mesh, options: Options,
               local: LocalBuffers) -> PlanBook:
    """One plan per step's inputs (generation's decode first, then prefill), of a model
    whose `local` buffers (a KV cache) each rank keeps its block of: the first plan fixes
    every state tensor's layout and the later ones keep it, as on the ranks."""
    mesh.ranks_per_node(options.nodes)
    state = whole_state(model)
    plans: list[Plan] = []
    pinned: Optional[dict] = None
    for inputs in steps:
        traced = trace(model, *planning_inputs(model, inputs, {}), options.param_dtype)
        plans.append(plan_graph(traced, mesh, options, pinned, local))
        if pinned is None:
            pinned = {name: spec.placements for name, (_, spec) in
                      state_owners(traced, plans[-1], state.__getitem__).items()}
    return PlanBook(tuple(plans))
