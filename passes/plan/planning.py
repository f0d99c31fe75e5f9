"""Planning without processes: trace -> strategies -> costs -> solve."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from autopar import _compat
from autopar.core.kinds import StepKind
from autopar.core.links import AxisLink, LinkKind, link_overrides
from autopar.core.mesh import Mesh
from autopar.core.options import CostSource, Options
from autopar.core.placement import Placement
from autopar.core.plan import Plan
from autopar.cost_models.devices import DeviceSpec, budget_words, preset
from autopar.cost_models.model import CostModel
from autopar.core.files import read_json
from autopar.cost_models.profile import Profile, compute_key, program_factor_of
from autopar.cost_models.shipped import shipped_profile_path
from autopar.core.errors import SolverError
from autopar.passes.solve.solve import solve
from autopar.passes.solve.solver_backend import solver_name
from autopar.passes.solve.warm_start import StartingLayouts, merges, refined
from autopar.passes.strategies.output_layouts import outputs_left_split
from autopar.passes.strategies.strategies import AnnotatedGraph, annotate
from autopar.passes.trace.stretch import stretched_trace
from autopar.passes.trace.trace import TracedGraph


def plan_traced(traced: TracedGraph, mesh: Mesh, options: Options,
                pinned: Optional[dict[str, tuple[Placement, ...]]] = None,
                profile: Optional[Profile] = None) -> tuple[AnnotatedGraph, Plan]:
    """Strategies, costs and the solve for a traced graph. `profile`: measured costs to
    use (compute timings and calibrated links); without one, Options.cost_model names a
    saved profile or "analytic"."""
    graph = annotate(traced, mesh, pinned, options.discover_rules)
    return graph, plan_annotated(graph, options, profile)


def plan_annotated(graph: AnnotatedGraph, options: Options, profile: Optional[Profile] = None,
                   coarse: Optional[Plan] = None, memory_price: float = 0.0) -> Plan:
    """The solve for a graph whose strategies are known (the profiler times those
    strategies' ops first, so it annotates once and plans from the same graph). On a
    mesh of three axes or more the solver starts from the plan of the mesh with two
    adjacent axes merged (passes/solve/warm_start.py): `coarse` when it is the plan of
    one such merge, else the innermost merge's, solved here first. `memory_price`:
    seconds per byte (passes/solve/solve.py solve)."""
    if options.sharded_outputs:
        graph = outputs_left_split(graph)
    traced, mesh = graph.traced, graph.mesh
    training = traced.training if options.training is None else options.training
    costs = CostModel.analytic(options.device, mesh.shape, training, options.nodes, link_overrides(options.links))
    source = ""  # where a saved profile was read from, for the note
    if profile is None and options.cost_model is CostSource.SAVED:
        source = options.profile_path or shipped_profile_path(costs.device.name)
        profile = load_profile(source)
    note = f"analytic preset {costs.device.name}" + _device_words(costs.device)
    if profile is not None:
        missed: set[str] = set()  # the op shapes the profile has no timing for (priced analytically)
        in_program, own_graph = program_factor_of(profile, traced.fingerprint, mesh.shape, training)
        costs = replace(costs, compute_table=_noting_misses(profile, missed), backward_table=profile.backward_s,
                        measured_links=profile.links(mesh.shape, mesh.link_kinds(options.nodes)),
                        compute_scale=profile.cpu_contention * in_program,
                        collective_sync_s=profile.collective_sync_s or 0.0)
    plan = solve(graph, costs, options, _warm_start(graph, options, coarse), memory_price)
    if profile is not None:
        measured_links = sorted({f"axis {a} {k}" for a, k in costs.measured_links})
        shipped = f", the profile autopar ships: {os.path.basename(source)}" \
            if source and options.profile_path is None else ""
        note = (f"profile of {profile.device} (torch {profile.torch_version}{shipped}): {len(missed)} op timings "
                f"missing, analytic instead; links {'measured' if measured_links else 'from the preset'}"
                + (f"; compute x{profile.cpu_contention:g} for ranks sharing cores" if profile.cpu_contention != 1
                   else "")
                + (f"; ops x{in_program:.3g} inside the rank program (measured"
                   + ("" if own_graph else " on another graph") + ")" if in_program != 1.0 else "")
                + (f"; {profile.collective_sync_s * 1e3:.2f} ms per collective waiting for ranks sharing cores"
                   if profile.collective_sync_s else ""))
    budget = budget_words(options.memory_budget_bytes, costs.device)
    note += f"; {budget}" if budget else ""
    return replace(plan, cost_note=note, links=axis_links(costs, mesh.link_kinds(options.nodes)))


def _warm_start(graph: AnnotatedGraph, options: Options, coarse: Optional[Plan]) -> Optional[StartingLayouts]:
    """The start of a mesh of three axes or more: `coarse` carried over where it is the
    plan of one of its merges, else the plan of its innermost merge, solved here."""
    merged = merges(graph.mesh)
    if not merged or solver_name(options) != "highs":  # CBC takes no start here
        return None
    handed = {m.shape: k for m, k in merged}
    if coarse is not None and coarse.mesh.shape in handed:
        return refined(coarse, handed[coarse.mesh.shape])
    mesh, axis = merged[-1]  # the innermost merge (merged_axes)
    try:
        coarse = plan_annotated(annotate(graph.traced, mesh, None, options.discover_rules), options)
    except SolverError:  # no plan on the merged mesh (its budget, say): the finer one starts from nothing
        return None
    return refined(coarse, axis)


class DeviceMemoryWarning(UserWarning):
    """A plan predicted to need more memory per rank than its device has."""


def _device_words(device: DeviceSpec) -> str:
    """What the summary says of the device: what "auto" detected, and its memory."""
    memory = f"{device.memory_bytes / 2**30:.1f} GiB per device" if device.memory_bytes else ""
    found = f"auto-detected {device.detected}" if device.detected else ""
    return f" ({', '.join(w for w in (found, memory) if w)})" if found or memory else ""


def warn_over_memory(plan: Plan, options: Options) -> None:
    """A DeviceMemoryWarning for a chosen plan predicted over its device's memory (the
    planner's entries call it once, on the plan they return, not on every candidate)."""
    device = preset(options.device) if isinstance(options.device, str) else options.device
    if device.memory_bytes and plan.memory_bytes > device.memory_bytes:
        warnings.warn(DeviceMemoryWarning(
            f"the plan of {plan.model_name} on mesh {plan.mesh.shape} is predicted to need "
            f"{plan.memory_bytes / 2**30:.1f} GiB per rank, more than the {device.memory_bytes / 2**30:.1f} GiB of "
            f"one {device.detected or device.name}: set Options(memory_budget_bytes=...) (parameters may then be "
            "stored sharded and gathered where used, blocks recomputed), or use a larger mesh"), stacklevel=4)


def _noting_misses(profile: Profile, missed: set[str]) -> Any:
    """The profile's compute lookup, adding each key it lacks to `missed`."""
    def lookup(target: Any, inputs: tuple, outputs: tuple) -> Optional[float]:
        value = profile.compute_s(target, inputs, outputs)
        if value is None:
            missed.add(compute_key(target, inputs, outputs))
        return value
    return lookup


def axis_links(costs: CostModel, kinds: tuple[LinkKind, ...]) -> tuple[AxisLink, ...]:
    """The link each mesh axis was priced with, for the Plan: the calibrated all-reduce
    fit where the profile has one, else the preset's (or Options.links') link."""
    return tuple(AxisLink(kind, costs.measured_links.get((axis, StepKind.ALL_REDUCE.value)) or costs.link(axis))
                 for axis, kind in enumerate(kinds))


def trace_for_planning(model: nn.Module, args: Any = (), kwargs: Optional[dict] = None,
                       param_dtype: Optional[torch.dtype] = None) -> TracedGraph:
    """Trace with example inputs; a model without weights (meta device) plans on shapes
    alone, so its inputs move to meta too. `param_dtype`: Options.param_dtype. A model of
    many alike blocks is traced through its first few (passes/trace/stretch.py)."""
    return stretched_trace(model, *planning_inputs(model, args, kwargs), param_dtype)


def planning_inputs(model: nn.Module, args: Any = (), kwargs: Optional[dict] = None) -> tuple[tuple, dict]:
    """The (args, kwargs) trace_for_planning traces with: on meta for a model on meta."""
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    if any(p.device.type == "meta" for p in model.parameters()):
        args, kwargs = inputs_on_meta(args, kwargs)
    return args, kwargs


def inputs_on_meta(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    leaves, tree = _compat.tree_flatten((tuple(args), dict(kwargs)))
    return _compat.tree_unflatten([x.to("meta") if isinstance(x, torch.Tensor) else x for x in leaves], tree)


def options_with(options: Optional[Options], overrides: dict) -> Options:
    """`options` (default Options()) with keyword overrides; a clear error for an unknown one."""
    base = options or Options()
    try:
        return replace(base, **overrides)
    except TypeError as e:
        raise TypeError(f"unknown planning option: {e}; see autopar.Options for the fields") from None


def load_profile(path: str) -> Profile:
    """A saved cost profile (Options.cost_model "saved", its file Options.profile_path)."""
    return Profile.from_dict(read_json(path, "profile", "delete it to measure again"), f"profile {path}")
