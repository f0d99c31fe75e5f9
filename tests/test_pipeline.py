"""Pipeline parallelism: the stage DP in closed form, pipelined plans and their JSON, the
errors for impossible requests, and (slow) losses and gradients on gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.core.pipeline import PipelineError, Schedule, Stage
from autopar.core.plan import Plan
from autopar.passes.pipeline import Units, microbatch_inputs, split_stages, step_time
from tests.models import build, inputs


def _gpt2(layers: int = 4):
    model = build("gpt2", n_layer=layers).train()
    return model, inputs("gpt2", batch=4)[1]


@pytest.fixture(scope="module")
def gpt2_plans():
    warnings.simplefilter("ignore")
    model, kw = _gpt2(2)
    piped = autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis=0, microbatches=2)
    auto = autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis="auto", microbatches=2)
    plain = autopar.plan(model, (), kw, mesh=(2, 2))
    return piped, auto, plain


def test_split_balances_the_slowest_stage():
    # blocks of 1 s; 2 s before the first block: stage 0 takes one block, stage 1 three
    units = Units("h", (1.0, 1.0, 1.0, 1.0), 2.0, 0.0, (0, 0, 0))
    assert split_stages(units, (0.0, 0.0, 0.0), 2) == ((0, 1), (1, 4))
    assert split_stages(Units("h", (1.0,) * 4, 0.0, 0.0, (0, 0, 0)), (0.0,) * 3, 2) == ((0, 2), (2, 4))
    # a costly boundary after block 1 moves the cut
    assert split_stages(Units("h", (1.0,) * 4, 0.0, 0.0, (0, 0, 0)), (0.0, 5.0, 0.0), 2) == ((0, 1), (1, 4))


def test_step_time_is_microbatches_times_slowest_plus_bubble():
    stages = (Stage(0, 0, 0, 2, 3.0, 10, 0.5), Stage(1, 1, 2, 4, 2.0, 0, 0.0))
    step, bubble = step_time(stages, ranks=2, microbatches=8)
    assert bubble == pytest.approx(3.5) and step == pytest.approx(8 * 3.5 + 3.5)


def test_pipelined_plan_records_stages_and_round_trips(gpt2_plans):
    piped, _, plain = gpt2_plans
    p = piped.pipeline
    assert p.axis == 0 and p.microbatches == 2 and p.schedule is Schedule.ONE_F_ONE_B
    assert p.container == "transformer.h" and p.blocks == 2
    assert [(s.first, s.stop) for s in p.stages] == [(0, 1), (1, 2)] and p.split_points == ("transformer.h.1",)
    hidden = 2 * 8 * 32 * 4  # one microbatch's hidden states, fp32; then the labels and masks the head reads
    assert hidden < p.stages[0].send_bytes <= hidden + 256 and p.stages[1].send_bytes == 0
    assert piped.total_s == pytest.approx(p.step_s)
    again = Plan.from_dict(piped.to_dict())
    assert again == piped and again.digest() == piped.digest()
    assert "pipeline" not in plain.to_dict() and plain.pipeline is None


def test_auto_keeps_the_cheaper(gpt2_plans):
    piped, auto, plain = gpt2_plans
    assert auto.total_s == pytest.approx(min(plain.total_s, piped.total_s, auto.total_s))
    assert auto.total_s <= plain.total_s


def test_bad_requests_name_the_value_and_the_fix():
    model, kw = _gpt2(2)
    with pytest.raises(PipelineError, match=r"microbatches=3 does not divide the batch.*pick microbatches"):
        microbatch_inputs((), kw, 3)
    with pytest.raises(PipelineError, match=r"asks for 4 stages .* only 2 blocks in transformer.h"):
        autopar.plan(model, (), kw, mesh=(4, 1), pipeline_axis=0, microbatches=2)
    with pytest.raises(PipelineError, match=r"pipeline_axis=2 is not an axis of mesh \(2, 2\)"):
        autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis=2)
    with pytest.raises(PipelineError, match=r"schedule 'zigzag' is not known"):
        autopar.Options(pipeline_schedule="zigzag")
