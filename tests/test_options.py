"""Options: modes as enums (their names still accepted), one field per fact, the planning
and running groups, and an OptionsError naming the field for anything else."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.core.options import (Clustering, CostSource, Options, OptionsError, PlanningOptions, RunningOptions,
                                  SolverChoice)
from autopar.core.pipeline import PipelineAxis, Schedule


def test_mode_names_become_enums_and_equal_options_compare_equal():
    named = Options(cost_model="profile", cluster_layers="all", solver="cbc", pipeline_axis="auto",
                    pipeline_schedule="gpipe")
    assert (named.cost_model, named.cluster_layers, named.solver, named.pipeline_axis, named.pipeline_schedule) == (
        CostSource.PROFILE, Clustering.ALL, SolverChoice.CBC, PipelineAxis.AUTO, Schedule.GPIPE)
    assert named == Options(cost_model=CostSource.PROFILE, cluster_layers=Clustering.ALL, solver=SolverChoice.CBC,
                            pipeline_axis=PipelineAxis.AUTO, pipeline_schedule=Schedule.GPIPE)
    assert hash(named) == hash(Options(cost_model="profile", cluster_layers="all", solver="cbc",
                                       pipeline_axis="auto", pipeline_schedule="gpipe"))
    # the older spellings: booleans for clustering, True/False for dynamic
    assert Options(cluster_layers=False).cluster_layers is Clustering.OFF
    assert Options(cluster_layers=True).cluster_layers is Clustering.INNER
    assert Options(dynamic=False).dynamic is None and isinstance(Options(dynamic=True).dynamic, autopar.Dynamic)


def test_a_profile_file_is_its_own_field():
    assert Options(cost_model="saved", profile_path="p.json").profile_path == "p.json"
    # without a file, "saved" reads the profile autopar ships for the device (tests/test_profile.py)
    assert Options(cost_model="saved").profile_path is None
    with warnings.catch_warnings(record=True) as caught:  # a path as the mode: the older spelling, read as saved
        warnings.simplefilter("always")
        old = Options(cost_model="/tmp/profile.json")
    assert (old.cost_model, old.profile_path) == (CostSource.SAVED, "/tmp/profile.json")
    assert any(issubclass(w.category, DeprecationWarning) and "profile_path" in str(w.message) for w in caught)
    with pytest.raises(OptionsError, match="beside profile_path"):
        Options(cost_model="/tmp/a.json", profile_path="/tmp/b.json")


@pytest.mark.parametrize("field, value, says", [
    ("cluster_layers", "some", r"Options.cluster_layers='some' is not one of \['inner', 'all', 'off'\]"),
    ("solver", "gurobi", r"Options.solver='gurobi' is not one of \['auto', 'highs', 'cbc'\]"),
    ("time_limit_s", 0, "Options.time_limit_s=0 is not a positive number of seconds"),
    ("collective_timeout_s", "300", "Options.collective_timeout_s='300' is not a positive number"),
    ("memory_budget_bytes", -1, "Options.memory_budget_bytes=-1 is not a positive int"),
    ("overlap", 1, r"Options.overlap=1 is not a bool"),
    ("training", "yes", "Options.training='yes' is not True, False or None"),
    ("max_inflight_bytes", 0, "Options.max_inflight_bytes=0 is not an int >= 1"),
    ("grad_sync_every", 0, "Options.grad_sync_every=0 is not an int >= 1"),
    ("mip_gap", 1.0, r"Options.mip_gap=1.0 is not a fraction in \[0, 1\)"),
    ("pipeline_axis", "first", r"Options.pipeline_axis='first' is not one of \['auto'\] or a mesh axis number"),
    ("sharded_outputs", "yes", r"Options.sharded_outputs='yes' is not a bool"),
])
def test_a_bad_value_is_an_options_error_naming_the_field(field, value, says):
    with pytest.raises(OptionsError, match=says):
        Options(**{field: value})
    with pytest.raises(OptionsError, match=says):  # the keyword shortcuts check alike
        autopar.plan(torch.nn.Linear(2, 2), (torch.randn(2, 2),), **{field: value})


def test_the_planning_and_running_groups_split_the_fields_between_them():
    from dataclasses import fields
    options = Options(device="h100", overlap=False, reduce_dtype=torch.bfloat16, microbatches=4)
    planning, running = options.planning, options.running
    assert isinstance(planning, PlanningOptions) and isinstance(running, RunningOptions)
    assert (planning.device, planning.microbatches, running.overlap, running.reduce_dtype) == (
        "h100", 4, False, torch.bfloat16)
    names = [f.name for f in fields(PlanningOptions)] + [f.name for f in fields(RunningOptions)]
    assert sorted(names) == sorted(f.name for f in fields(Options)), "every option is in exactly one group"
