"""The memory budget bounds the pipeline stage split: the DP in closed form on synthetic
block bytes, the error when no split fits, and planned GPT-2 within the budget. Also the
microbatch counts torch's schedules refuse, refused when planning."""

from __future__ import annotations

import pickle
from dataclasses import replace
import warnings

import pytest

import autopar
from autopar.core.errors import MemoryBudgetError
from autopar.core.kinds import StepKind
from autopar.core.options import Options
from autopar.core.pipeline import PipelineError, PipelineMemoryError, Schedule, check_microbatches
from autopar.passes.plan import pipeline
from autopar.passes.plan.pipeline import _fitting_split
from autopar.passes.plan.pipeline_split import MemoryBound, Units, smallest_split, split_stages
from tests.models import build, inputs

FREE = (0.0, 0.0, 0.0)  # free sends between 4 blocks


def _units(params=(0, 0, 0, 0), acts=(0, 0, 0, 0)) -> Units:
    """Four 1 s blocks with the given bytes (no state)."""
    return Units("h", (1.0,) * 4, 0.0, 0.0, (0, 0, 0), params, (0,) * 4, acts)


def test_a_budget_forces_a_slower_split_that_fits():
    heavy_last = _units(params=(10, 10, 10, 40))
    assert split_stages(heavy_last, FREE, 2) == ((0, 2), (2, 4))  # the fastest: 2 s a stage, 20 and 50 bytes
    bound = MemoryBound(45, Schedule.ONE_F_ONE_B, 2)
    assert split_stages(heavy_last, FREE, 2, bound) == ((0, 3), (3, 4))  # 3 s, but 30 and 40 bytes
    assert split_stages(heavy_last, FREE, 2, MemoryBound(50, Schedule.ONE_F_ONE_B, 2)) == ((0, 2), (2, 4))


def test_activations_count_once_per_microbatch_in_flight():
    acts = _units(acts=(10, 10, 10, 10))
    # 1F1B with 4 microbatches: stage 0 holds 2 in flight, stage 1 holds 1
    bound = MemoryBound(35, Schedule.ONE_F_ONE_B, 4)
    assert [bound.stage_bytes(acts, 0, 2, 0, 2), bound.stage_bytes(acts, 2, 4, 1, 2)] == [40, 20]
    assert split_stages(acts, FREE, 2, bound) == ((0, 1), (1, 4))  # 20 and 30 bytes
    # GPipe holds all 4: the best split holds 80 bytes on each stage, over any budget below
    gpipe = MemoryBound(35, Schedule.GPIPE, 4)
    assert split_stages(acts, FREE, 2, gpipe) is None
    assert smallest_split(acts, 2, gpipe)[0] == ((0, 2), (2, 4))
    # interleaved: two stages a rank, each held to half the budget
    assert MemoryBound(35, Schedule.INTERLEAVED_1F1B, 4).stage_cap_bytes == 17


def test_no_split_fits_names_the_budget_the_smallest_and_the_fix():
    acts = _units(params=(5, 5, 5, 5), acts=(10, 10, 10, 10))
    options = Options(memory_budget_bytes=35, pipeline_schedule="gpipe", microbatches=4)
    with pytest.raises(PipelineMemoryError) as caught:
        _fitting_split(lambda: (acts,), acts, FREE, 2, options)
    e = caught.value
    assert isinstance(e, MemoryBudgetError) and e.budget_bytes == 35
    assert e.smallest_bytes == 10 + 4 * 20  # two blocks' parameters + 4 microbatches of two blocks
    assert all(word in str(e) for word in ("35 bytes", "90 bytes", "more stages", "'1f1b' with more microbatches",
                                           "larger mesh"))
    again = pickle.loads(pickle.dumps(e))  # as it reaches the other ranks
    assert type(again) is PipelineMemoryError and str(again) == str(e) and again.smallest_bytes == 90
    assert _fitting_split(lambda: (acts,), acts, FREE, 2, Options(memory_budget_bytes=90, pipeline_schedule="gpipe",
                                                                  microbatches=4))[0] == ((0, 2), (2, 4))


@pytest.fixture(scope="module")
def gpt2():
    warnings.simplefilter("ignore")
    model, kw = build("gpt2", n_layer=4).train(), inputs("gpt2", batch=4)[1]
    free = autopar.plan(model, (), kw, mesh=(2, 1), pipeline_axis=0, microbatches=2)
    return model, kw, free


def _plan(gpt2, budget: int, axis=0):
    model, kw, _ = gpt2
    return autopar.plan(model, (), kw, mesh=(2, 1), pipeline_axis=axis, microbatches=2, memory_budget_bytes=budget)


def test_a_stage_recomputes_inside_to_fit_rather_than_moving_the_split(gpt2):
    free = gpt2[2]
    assert [(s.first, s.stop) for s in free.pipeline.stages] == [(0, 2), (2, 4)]
    assert not any(sp.recompute for sp in free.stage_plans)
    budget = free.memory_bytes - 1  # the fastest layouts no longer fit on the heaviest rank
    bounded = _plan(gpt2, budget)
    assert bounded.memory_bytes <= budget and all(sp.memory_bytes <= budget for sp in bounded.stage_plans)
    # stage 0 holds two microbatches' activations under 1F1B: it recomputes a block, the
    # balanced split stays, and the step is slower than the free one by that forward
    assert [(s.first, s.stop) for s in bounded.pipeline.stages] == [(0, 2), (2, 4)]
    assert bounded.stage_plans[0].recompute and not bounded.stage_plans[1].recompute
    assert bounded.total_s > free.total_s
    assert bounded.pipeline.stages[0].step_s > free.pipeline.stages[0].step_s


def test_stage_plans_count_their_microbatches_in_flight(gpt2):
    free = gpt2[2]
    from autopar.passes.plan.pipeline import stage_solve_options
    solving = stage_solve_options(free, Options(memory_budget_bytes=None, microbatches=2, pipeline_axis=0))
    assert [o.activations_in_flight for o in solving] == [2, 1]  # 1F1B: stage 0 holds both microbatches
    assert all(o.pipeline_axis is None and o.microbatches == 1 for o in solving)


def test_planned_pipeline_that_cannot_fit_reports_what_would(gpt2):
    with pytest.raises(PipelineMemoryError, match=r"into 2 pipeline stages .* budget of 1000 bytes") as caught:
        _plan(gpt2, 1000)
    smallest = caught.value.smallest_bytes
    assert _plan(gpt2, smallest).memory_bytes <= smallest  # the reported figure is reachable


def test_auto_takes_a_fitting_pipeline_over_a_plain_plan_that_does_not(gpt2, monkeypatch):
    def plain_does_not_fit(traced, mesh, options):
        raise MemoryBudgetError(options.memory_budget_bytes, 10**9)
    monkeypatch.setattr(pipeline, "plan_traced", plain_does_not_fit)
    budget = gpt2[2].memory_bytes
    chosen = _plan(gpt2, budget, axis="auto")
    assert chosen.pipeline is not None and chosen.memory_bytes <= budget
    with pytest.raises(PipelineMemoryError):  # the pipeline's error: its smallest is below the plain one's
        _plan(gpt2, 1000, axis="auto")


def test_auto_falls_back_to_the_next_candidate_when_a_stage_graph_does_not_fit(gpt2, monkeypatch):
    """The split's prices said the pipeline fits, a stage's own graph does not: "auto" takes
    the next candidate (here the plain plan) instead of failing; a fixed axis, which has no
    other candidate, reports the pipeline's error."""
    ranked, tried = pipeline.ranked_plans, []

    def pipelines_first(*a):
        return sorted(ranked(*a), key=lambda plan: plan.pipeline is None)

    def stage_does_not_fit(model, args, kwargs, plan, options_of, pins_of=None, rank_budget=None):
        tried.append(plan.pipeline.axis)
        raise MemoryBudgetError(10**6, 2 * 10**6)
    monkeypatch.setattr(pipeline, "ranked_plans", pipelines_first)
    monkeypatch.setattr(pipeline, "stage_plans", stage_does_not_fit)
    chosen = _plan(gpt2, None, axis="auto")
    assert tried == [0] and chosen.pipeline is None and not chosen.stage_plans
    with pytest.raises(PipelineMemoryError, match="into 2 pipeline stages") as caught:
        _plan(gpt2, None, axis=0)
    assert caught.value.smallest_bytes == 2 * 10**6


def test_microbatches_torch_schedules_refuse_are_refused_when_planning(gpt2):
    check_microbatches(Schedule.GPIPE, 1, 4)
    check_microbatches(Schedule.ONE_F_ONE_B, 4, 4)
    with pytest.raises(PipelineError, match=r"microbatches=3 is fewer than the 4 stages of a 1F1B .*='gpipe'"):
        check_microbatches(Schedule.ONE_F_ONE_B, 3, 4)
    check_microbatches(Schedule.INTERLEAVED_1F1B, 4, 2)
    with pytest.raises(PipelineError, match=r"microbatches=5 is not a whole number of rounds of 2"):
        check_microbatches(Schedule.INTERLEAVED_1F1B, 5, 2)
    model, kw, _ = gpt2
    with pytest.raises(PipelineError, match=r"microbatches=1 is fewer than the 2 stages"):
        autopar.plan(model, (), kw, mesh=(2, 1), pipeline_axis=0, microbatches=1, pipeline_schedule="1f1b")


def test_interleaved_takes_a_split_whose_ranks_fit_though_a_stage_exceeds_half_the_budget():
    # 4 stages on 2 ranks (rank 0 holds stages 0 and 2): the only split puts 60 + 10 bytes on
    # rank 0 and 10 + 10 on rank 1, within 80, though stage 0 alone is over the 40 of budget / 2
    heavy_first = _units(params=(60, 10, 10, 10))
    options = Options(memory_budget_bytes=80, pipeline_schedule="interleaved_1f1b", microbatches=4)
    assert _fitting_split(lambda: (heavy_first,), heavy_first, FREE, 4, options)[0] == ((0, 1), (1, 2), (2, 3), (3, 4))
    with pytest.raises(PipelineMemoryError) as caught:  # below the heaviest rank: refused, with that figure
        _fitting_split(lambda: (heavy_first,), heavy_first, FREE, 4, replace(options, memory_budget_bytes=69))
    assert caught.value.smallest_bytes == 70


def test_a_node_count_that_does_not_divide_the_sub_mesh_still_plans(gpt2):
    # the stage prices are made on the sub-mesh with the node count that gives its axes
    # the link kinds they have in the whole mesh (4 nodes of (4, 2): axis 1 inside a node)
    model, kw, _ = gpt2
    plan = autopar.plan(model, (), kw, mesh=(4, 2), nodes=4, pipeline_axis=0, microbatches=4)
    assert plan.pipeline is not None and len(plan.stage_plans) == 4


def test_memory_priced_plans_may_store_parameters_sharded(gpt2):
    # a price on memory makes the same choices a budget does: parameters stored sharded
    # and gathered where used (not merely in the layout their reader wants), blocks recomputed
    from autopar.core.mesh import Mesh
    from autopar.passes.plan.planning import plan_annotated, trace_for_planning
    from autopar.passes.strategies.strategies import annotate
    model, kw, _ = gpt2
    graph = annotate(trace_for_planning(model, (), kw), Mesh.of((2,)), None, True)
    options = Options(training=True, memory_budget_bytes=None)
    free = plan_annotated(graph, options)
    priced = plan_annotated(graph, options, memory_price=1024 * free.total_s / free.memory_bytes)
    assert priced.param_bytes < free.param_bytes and priced.memory_bytes < free.memory_bytes
    assert priced.recompute and priced.total_s > free.total_s
    stored = {n.name for n in priced.nodes if n.kind.is_state and not n.outputs[0].is_replicated()}
    gathered = {e.producer for e in priced.edges if e.producer in stored
                and any(step.kind is StepKind.ALL_GATHER for step in e.steps)}
    # a block's own parameters too, each read once (the tied wte / lm_head is read twice)
    assert any(name.startswith("p_transformer_h_") for name in gathered), gathered


def test_a_bf16_split_leaves_the_masters_and_their_tied_copies_exact(gpt2):
    # GPT-2's wte and lm_head are one tensor: torch's split copies it into the last stage
    # while the parameters are cast; that copy takes the fp32 master's value back
    import torch
    from autopar.passes.plan.pipeline_stages import split_stages
    model, kw, free = gpt2
    before = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    small = {k: v[:2] for k, v in kw.items()}
    split = split_stages(model, (), small, free.pipeline, True, torch.bfloat16)
    masters = dict(model.named_parameters(remove_duplicate=False))
    for name, p in masters.items():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name
    for module in split.modules:
        for name, q in module.named_parameters(remove_duplicate=False):
            if name in masters:
                assert q.dtype == torch.float32 and torch.equal(q, masters[name]), name


@pytest.mark.slow
def test_interleaved_stages_spend_what_their_rank_leaves_of_the_budget(monkeypatch):
    # GPT-2 with 8 layers in 4 stages on 2 pipeline ranks (interleaved 1F1B: rank 0 holds
    # stages 0 and 2). Each stage is first solved within half the budget: stage 0, holding
    # the most microbatches, recomputes both its blocks, while stage 2 leaves bytes unused.
    # Solved again with them, stage 0 recomputes one block: a faster step, and rank 0
    # still within the budget
    from autopar.passes.plan import pipeline_stages
    warnings.simplefilter("ignore")
    model, kw = build("gpt2", n_layer=8).train(), inputs("gpt2", batch=4)[1]
    options = dict(mesh=(2, 1), pipeline_axis=0, microbatches=4, pipeline_schedule="interleaved_1f1b")
    free = autopar.plan(model, (), kw, **options)
    budget = int(free.memory_bytes * 0.94)
    spent = autopar.plan(model, (), kw, memory_budget_bytes=budget, **options)
    monkeypatch.setattr(pipeline_stages, "spend_slack", lambda plans, *rest: tuple(plans))
    halves = autopar.plan(model, (), kw, memory_budget_bytes=budget, **options)
    assert [s.rank for s in spent.pipeline.stages] == [0, 1, 0, 1]
    assert [len(sp.recompute) for sp in halves.stage_plans][0] == 2
    assert [len(sp.recompute) for sp in spent.stage_plans][0] == 1
    for rank in (0, 1):
        held = sum(sp.memory_bytes for s, sp in zip(spent.pipeline.stages, spent.stage_plans) if s.rank == rank)
        assert held <= budget, (rank, held, budget)
    assert spent.memory_bytes <= budget
    assert all(a.total_s <= b.total_s for a, b in zip(spent.stage_plans, halves.stage_plans))
    assert spent.total_s < halves.total_s
