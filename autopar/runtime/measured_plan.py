"""Planning under the profiling cost model (Options.cost_model == "profile"): the ops the
strategies would run are timed on this machine first, then the first plan's program is
timed whole and the graph planned again with what that says of ops inside a program
(Profile.program_factor); the profile is saved for the next run."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from autopar.core.options import Options
from autopar.core.plan import Plan
from autopar.cost_models.profile import Profile
from autopar.passes.plan.planning import plan_annotated
from autopar.passes.plan.state_layouts import whole_state
from autopar.passes.strategies.strategies import AnnotatedGraph
from autopar.runtime.measure import calibrate_program, profile_compute, samples_of, save_profile


def measured_plan(graph: AnnotatedGraph, options: Options, profile: Profile, device: torch.device,
                  model: Optional[nn.Module], user: Optional[list[torch.Tensor]], profile_path: str) -> Plan:
    """`model`: the model with its weights (None on the meta device: the program is not
    timed whole); `user`: the call's inputs (None for a dynamic trace)."""
    training = graph.traced.training if options.training is None else options.training
    profile_compute(samples_of(graph, graph.mesh.shape), profile, device, options.profile_budget_s,
                    backward=training)
    plan = plan_annotated(graph, options, profile)
    if user is not None and model is not None and calibrate_program(
            graph.traced, plan, profile, device, whole_state(model), user, training, options.profile_budget_s):
        plan = plan_annotated(graph, options, profile)
    save_profile(profile, profile_path)
    return plan

