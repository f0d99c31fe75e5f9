"""The one way to plan a model offline: whichever kind of plan its options ask for.

    model, inputs, mesh, Options -> Plan
      pipeline_axis set   -> passes/plan/pipeline.py: stages chosen by the DP, every stage's plan inside
      dynamic set         -> passes/plan/dynamic_plans.py: one trace with symbolic sizes, planned at
                             the range's representative sizes
      otherwise           -> passes/plan/planning.py: trace, strategies, costs, solve
    model, step inputs, mesh, Options, local buffers -> PlanBook (plan_steps)
                             generation's decode and prefill plans, the first fixing every
                             state tensor's layout (autopar.plan_for_generation)

autopar.plan calls it; on ranks the first rank calls it for a pipelined plan
(autopar/runtime/stages.py), and a ParallelModule plans each traced graph it meets
through passes/plan/planning.py directly (it traces on rank 0 and ships the graph).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.plan import Plan
from autopar.core.plan_book import PlanBook
from autopar.passes.plan import pipeline
from autopar.passes.plan.buffer_layouts import LocalBuffers, plan_local_buffers
from autopar.passes.plan.dynamic_plans import DynamicPlans, PlannedGraph
from autopar.passes.plan.planning import plan_annotated, plan_traced, planning_inputs
from autopar.passes.plan.state_layouts import state_owners, whole_state
from autopar.passes.trace.trace import trace


def plan_model(model: nn.Module, args: Any, kwargs: Optional[dict], mesh: Mesh, options: Options) -> Plan:
    mesh.ranks_per_node(options.nodes)  # a node count that does not divide the mesh fails before tracing
    args, kwargs = planning_inputs(model, args, kwargs)
    if options.pipeline_axis is not None:
        return pipeline.plan_model(model, args, kwargs, mesh, options)
    if options.dynamic is not None:
        return _dynamic(model, args, kwargs, mesh, options)
    return plan_traced(trace(model, args, kwargs, options.param_dtype), mesh, options)[1]


def _dynamic(model: nn.Module, args: tuple, kwargs: dict, mesh: Mesh, options: Options) -> Plan:
    """The plan a dynamic ParallelModule would make at its first call with these inputs
    (the same graph fingerprint, so compile(..., plan=it, dynamic=the same) runs it)."""
    def traced_plan(a: tuple, kw: dict, shapes: tuple) -> PlannedGraph:
        traced = trace(model, *planning_inputs(model, a, kw), options.param_dtype, shapes)
        return PlannedGraph(traced, plan_traced(traced, mesh, options)[1])
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
        plans.append(plan_local_buffers(traced, mesh, options, pinned, local,
                                        lambda graph: plan_annotated(graph, options)))
        if pinned is None:
            pinned = {name: spec.placements for name, (_, spec) in
                      state_owners(traced, plans[-1], state.__getitem__).items()}
    return PlanBook(tuple(plans))
