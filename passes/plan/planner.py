"""The one way to plan a model offline: whichever kind of plan its options ask for.

    model, inputs, mesh, Options -> Plan
      pipeline_axis set   -> passes/plan/pipeline.py: stages chosen by the DP, every stage's plan inside
      dynamic set         -> passes/plan/dynamic_plans.py: one trace with symbolic sizes, planned at
                             the range's representative sizes
      otherwise           -> passes/plan/planning.py: trace, strategies, costs, solve

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
from autopar.passes.plan import pipeline
from autopar.passes.plan.dynamic_plans import DynamicPlans, PlannedGraph
from autopar.passes.plan.planning import plan_traced, planning_inputs
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
