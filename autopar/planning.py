"""Planning without processes: trace -> strategies -> costs -> solve."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from autopar.mesh import Mesh
from autopar.options import Options
from autopar.placement import Placement
from autopar.plan import Plan
from autopar.cost_models.model import CostModel
from autopar.passes.solve import solve
from autopar.passes.strategies import AnnotatedGraph, annotate
from autopar.passes.trace import TracedGraph, trace


def plan_traced(traced: TracedGraph, mesh: Mesh, options: Options,
                pinned: Optional[dict[str, tuple[Placement, ...]]] = None) -> tuple[AnnotatedGraph, Plan]:
    training = traced.training if options.training is None else options.training
    graph = annotate(traced, mesh, pinned)
    costs = CostModel.analytic(options.device, mesh.shape, training)
    return graph, solve(graph, costs, options)


def plan(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, mesh: Any = (1,),
         options: Optional[Options] = None, **option_overrides: Any) -> Plan:
    """Plan `model` for `mesh` offline (no process group): the Plan autopar.compile
    would run. Keyword overrides go to Options (e.g. device="h100", training=True)."""
    opts = _options(options, option_overrides)
    mesh_ = Mesh.of(mesh)
    traced = trace(model, tuple(args) if isinstance(args, (tuple, list)) else (args,), kwargs)
    return plan_traced(traced, mesh_, opts)[1]


def _options(options: Optional[Options], overrides: dict) -> Options:
    from dataclasses import replace
    base = options or Options()
    try:
        return replace(base, **overrides)
    except TypeError as e:
        raise TypeError(f"unknown planning option: {e}; see autopar.Options for the fields") from None
