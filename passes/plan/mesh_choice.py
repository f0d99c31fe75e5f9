"""mesh="auto": the planner chooses the mesh. Every factorisation of the device count
into one, two or three axes (each of two devices or more) is planned from one trace and
the cheapest predicted step is kept; the plan records every candidate (Plan.mesh_candidates,
plan.explain_mesh()).

On one node every axis has the same link, so meshes that differ only in the order of
their axes are the same problem (the ILP is symmetric under permuting them): one of each,
axes in ascending order. On several nodes the order decides which axes cross nodes (node-
major: the outer axes), so every order is tried. A candidate no plan of which fits
the memory budget is listed with the reason. Pipelines (pipeline_axis) and dynamic plans
are not chosen among yet.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Optional

from torch import nn

from autopar.core.errors import MeshError, OptionsError, SolverError
from autopar.core.mesh import Mesh
from autopar.core.options import CostSource, Options
from autopar.core.plan import Plan
from autopar.core.plan_parts import MeshCandidate
from autopar.passes.plan.planner import plan_graph
from autopar.passes.plan.planning import DeviceMemoryWarning, planning_inputs, warn_over_memory
from autopar.passes.solve.solver_backend import SolveStatus
from autopar.passes.solve.warm_start import merges
from autopar.passes.trace.stretch import stretched_trace
from autopar.passes.trace.trace import TracedGraph

MAX_AXES = 3


def factorisations(devices: int, max_axes: int = MAX_AXES) -> tuple[tuple[int, ...], ...]:
    """Ordered factorisations of `devices` into at most `max_axes` factors of 2 or more,
    fewer axes first ((devices,) alone for one device)."""
    if devices < 1:
        raise MeshError(f"mesh='auto' needs a positive device count, got {devices!r}")
    if devices == 1:
        return ((1,),)
    out: list[tuple[int, ...]] = []

    def grow(prefix: tuple[int, ...], rest: int) -> None:
        if rest == 1:
            out.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                grow(prefix + (f,), rest // f)

    grow((), devices)
    return tuple(sorted(out, key=len))


def mesh_candidates(devices: int, nodes: int = 1) -> tuple[Mesh, ...]:
    """The meshes mesh="auto" tries (module docstring)."""
    Mesh((devices,)).ranks_per_node(nodes)  # a node count that does not divide the devices is refused
    shapes = factorisations(devices)
    if nodes == 1:
        shapes = tuple(dict.fromkeys(tuple(sorted(s)) for s in shapes))
    return tuple(Mesh(s) for s in shapes)


def check_mesh_request(options: Options) -> None:
    """What mesh="auto" cannot choose among yet, refused before anything is traced."""
    if options.pipeline_axis is not None or options.dynamic is not None:
        raise OptionsError("mesh='auto' chooses among plain plans only: give a mesh with pipeline_axis= or dynamic=")
    if options.cost_model is CostSource.PROFILE:
        raise OptionsError("mesh='auto' prices its candidates analytically or by a saved profile: cost_model="
                           "'profile' measures on one mesh, so give that mesh")


def chosen_plan(traced: TracedGraph, devices: int, options: Options) -> Plan:
    """The cheapest plan of `traced` over the meshes of `devices` devices, with every
    candidate recorded; a SolverError listing them when none has a plan."""
    check_mesh_request(options)
    tried: list[MeshCandidate] = []
    best: Optional[Plan] = None
    planned: dict[tuple[int, ...], Plan] = {}  # a three-axis candidate starts from a merged mesh's plan
    for mesh in mesh_candidates(devices, options.nodes):
        try:
            with warnings.catch_warnings():  # the plan returned warns, once (below)
                warnings.simplefilter("ignore", DeviceMemoryWarning)
                plan = plan_graph(traced, mesh, options, coarse=cheapest_merge(mesh, planned))
        except SolverError as e:  # a MemoryBudgetError among them
            tried.append(MeshCandidate(mesh.shape, None, None, f"{type(e).__name__}: {e}"))
            continue
        planned[mesh.shape] = plan
        tried.append(MeshCandidate(mesh.shape, plan.total_s, plan.memory_bytes, bound_s=_unproven_bound(plan)))
        if best is None or plan.total_s < best.total_s:
            best = plan
    if best is None:
        raise SolverError(f"no mesh of {devices} devices has a plan for {traced.model_name}:\n"
                          + "\n".join(f"  {c}" for c in tried))
    warn_over_memory(best, options)
    return replace(best, mesh_candidates=tuple(tried))


def cheapest_merge(mesh: Mesh, planned: dict[tuple[int, ...], Plan]) -> Optional[Plan]:
    """Of the plans made for `mesh` with two adjacent axes merged, the cheapest (the first
    of equals): every such plan is one of `mesh`'s, so the solve starts no worse than the
    best candidate it refines ((2, 4, 8) over 8 nodes from (8, 8), not from (2, 32))."""
    made = [planned[m.shape] for m, _ in merges(mesh) if m.shape in planned]
    return min(made, key=lambda p: p.total_s, default=None)


def _unproven_bound(plan: Plan) -> Optional[float]:
    """None where the solver proved `plan` its mesh's cheapest; else the lower bound it
    proved (0.0 where it proved none)."""
    if plan.solver.status == SolveStatus.OPTIMAL.value:
        return None
    return plan.solver.bound_s or 0.0


def plan_mesh_choice(model: nn.Module, args: Any, kwargs: Optional[dict], devices: int, options: Options) -> Plan:
    """chosen_plan of `model` traced once with these inputs."""
    check_mesh_request(options)
    args, kwargs = planning_inputs(model, args, kwargs)
    return chosen_plan(stretched_trace(model, args, kwargs, options.param_dtype), devices, options)
