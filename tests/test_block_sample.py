"""The stage split priced on a sample of alike blocks (passes/plan/block_sample.py): the
sample's stretched Units are the whole graph's, the pipelined plan is the one priced on the
whole graph, blocks that differ are priced whole, and a given plan is checked against the
model's depth. Also passes/plan/forked.py, which the stages are planned in."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.core.errors import FingerprintMismatchError, MemoryBudgetError
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan import block_sample, forked, pipeline
from autopar.passes.plan.block_sample import priced_trace, stretched
from autopar.passes.trace.stretch import BlockSample, alike_blocks, cut
from autopar.passes.plan.pipeline import SubMeshSolves, microbatch_inputs
from autopar.passes.plan.planning import trace_for_planning
from autopar.runtime.stages import _checked
from tests.models import MLP, build, inputs


def _llama(layers: int):
    warnings.simplefilter("ignore")
    return build("llama", num_hidden_layers=layers).train(), inputs("llama", batch=4)[1]


def test_alike_blocks_are_found_and_unlike_ones_are_not():
    model, _ = _llama(6)
    assert alike_blocks(model) == BlockSample("model.layers", 6)
    assert alike_blocks(_llama(4)[0]) is None  # no more blocks than the sample holds
    assert alike_blocks(build("deepseek_v3", num_hidden_layers=6)) is None  # a dense first layer, then experts
    model.model.layers[3].self_attn.scaling = 0.5  # one block computes otherwise
    assert alike_blocks(model) is None
    assert alike_blocks(MLP((16,) * 8)) == BlockSample("layers", 7)
    experts = nn.ModuleList(nn.Sequential(nn.ModuleList(nn.Linear(4, 4) for _ in range(8))) for _ in range(5))
    assert alike_blocks(nn.ModuleDict({"layers": experts})) == BlockSample("layers", 5)  # not a block's experts


def test_cut_holds_the_sample_and_puts_the_blocks_back():
    model, _ = _llama(6)
    layers = model.model.layers
    with cut(model, alike_blocks(model)):
        assert len(model.model.layers) == block_sample.SAMPLE
        assert model.model.layers[3] is layers[3]
    assert model.model.layers is layers and len(layers) == 6


@pytest.mark.parametrize("budget", [None, pytest.param(2**20, marks=pytest.mark.slow)])
def test_stretched_units_are_the_whole_graphs(budget):
    """Every block's seconds and bytes, every boundary's bytes, and the parts before and
    after: from the 4-block sample, as from tracing all 7 blocks (with a budget: the leaner
    frontier's too)."""
    model, kw = _llama(7)
    options = Options(microbatches=2, memory_budget_bytes=budget)
    mb_args, mb_kwargs = microbatch_inputs((), kw, 2)
    sample = alike_blocks(model)
    whole = SubMeshSolves(trace_for_planning(model, mb_args, mb_kwargs), options)
    sampled = SubMeshSolves(priced_trace(model, mb_args, mb_kwargs, None, sample), options, sample)
    mesh = Mesh.of((2, 2))
    pairs = [(whole.fastest(mesh, 0)[0], sampled.fastest(mesh, 0)[0])]
    if budget is not None:
        pairs += list(zip(whole.leaner(mesh, 0), sampled.leaner(mesh, 0)))
    for a, b in pairs:
        assert len(b.block_s) == 7 and len(b.boundary_bytes) == 6
        assert b.block_s == pytest.approx(a.block_s, rel=1e-9)
        assert (b.before_s, b.after_s) == pytest.approx((a.before_s, a.after_s), rel=1e-9)
        assert (b.boundary_bytes, b.param_bytes, b.state_bytes, b.activation_bytes) == \
            (a.boundary_bytes, a.param_bytes, a.state_bytes, a.activation_bytes)


def test_a_sample_whose_inner_blocks_differ_is_not_stretched():
    units = pipeline.Units("model.layers", (1.0, 2.0, 2.5, 1.0), 0.0, 0.0, (8, 8, 8))
    assert stretched(units, BlockSample("model.layers", 9)) is None
    alike = dataclasses.replace(units, block_s=(1.0, 2.0, 2.0, 3.0), boundary_bytes=(4, 8, 16))
    out = stretched(alike, BlockSample("model.layers", 6))
    assert out.block_s == (1.0, 2.0, 2.0, 2.0, 2.0, 3.0) and out.boundary_bytes == (4, 8, 8, 8, 16)
    assert stretched(alike, BlockSample("model.other", 6)) is None  # not the container the graph split


@pytest.fixture(scope="module")
def llama6_plans():
    """Llama with 6 blocks pipelined on (2, 2): (model, inputs, the plan priced on its sample,
    the plan priced on its whole graph)."""
    model, kw = _llama(6)
    request = dict(mesh=(2, 2), pipeline_axis=0, microbatches=2)
    sampled = autopar.plan(model, (), kw, **request)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pipeline, "alike_blocks", lambda model: None)
        whole = autopar.plan(model, (), kw, **request)
    return model, kw, sampled, whole


@pytest.mark.slow
def test_the_pipelined_plan_is_the_one_priced_on_the_whole_graph(llama6_plans):
    model, kw, sampled, whole = llama6_plans
    assert sampled.pipeline.stages == whole.pipeline.stages
    assert sampled.total_s == pytest.approx(whole.total_s, rel=1e-12)
    assert [p.fingerprint for p in sampled.stage_plans] == [p.fingerprint for p in whole.stage_plans]
    assert sampled.fingerprint != whole.fingerprint  # each carries the graph its split was priced on
    for plan in (sampled, whole):  # and a given plan is checked against the graph it carries
        assert _checked(plan, model, (), kw, Options(microbatches=2)) is plan


class _Alternating(nn.Module):
    """Blocks alike in every attribute, but odd ones compute otherwise (by their place)."""

    def __init__(self, place: int) -> None:
        super().__init__()
        self.layer_idx, self.linear = place, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return torch.relu(y) + x if self.layer_idx % 2 else y @ y.transpose(-1, -2) @ x / 16


class _Stack(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Alternating(i) for i in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_blocks_that_compute_by_their_place_are_priced_whole(monkeypatch):
    model = _Stack(6).train()
    x = torch.randn(4, 8, 16)
    traced = []
    real = block_sample.trace_for_planning
    monkeypatch.setattr(block_sample, "trace_for_planning", lambda *a, **k: traced.append(real(*a, **k)) or traced[-1])
    assert alike_blocks(model) == BlockSample("blocks", 6)
    plan = autopar.plan(model, (x,), {}, mesh=(2, 2), pipeline_axis=0, microbatches=2)
    assert [len(t.gm.graph.nodes) < len(traced[-1].gm.graph.nodes) for t in traced] == [True, False]
    assert plan.fingerprint == traced[-1].fingerprint and plan.pipeline.blocks == 6
    assert _checked(plan, model, (x,), {}, Options(microbatches=2)) is plan


@pytest.mark.slow
def test_a_given_plan_for_another_depth_is_refused(llama6_plans):
    _, kw, plan, _ = llama6_plans
    deeper, _ = _llama(8)
    with pytest.raises(FingerprintMismatchError, match="splits 6 blocks of model.layers into stages, but this "
                                                       "LlamaForCausalLM has 8"):
        _checked(plan, deeper, (), kw, Options(microbatches=2))


def test_forked_jobs_come_back_in_order_and_the_first_failure_is_raised():
    here = os.getpid()
    assert forked.map_forked(lambda i: (i * i, os.getpid() != here or not forked.forks()), range(5)) == \
        [(i * i, True) for i in range(5)]

    def job(i: int) -> int:
        if i in (2, 3):
            raise ValueError(f"job {i} fails")
        return i
    with pytest.raises(ValueError, match="job 2 fails"):
        forked.map_forked(job, range(5))
    assert forked.map_forked(job, [0, 1], workers=1) == [0, 1]  # one worker: here, in order
    with forked.started(lambda: job(1) + os.getpid()) as one, forked.started(lambda: job(2)) as two:
        assert one() - here != 1 or not forked.forks()  # made in another process
        assert isinstance(two(), ValueError) and str(two()) == "job 2 fails"
        with pytest.raises(ValueError, match="job 2 fails"):
            forked.raised(two())


@pytest.mark.slow
def test_auto_with_the_plain_plan_made_in_a_worker_chooses_as_in_one_process(monkeypatch):
    """pipeline_axis="auto" with workers: the plain plan is made in one while the cheapest
    pipeline gets its stage plans; the choice is the one-process loop's, whether the plain
    plan wins (a tiny model) or does not fit (then the pipeline, with its stage plans)."""
    model, kw = _llama(6)
    request = dict(mesh=(2, 2), pipeline_axis="auto", microbatches=2)

    def plain_does_not_fit(traced, mesh, options, *a, **k):
        raise MemoryBudgetError(10**6, 2 * 10**6)
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(pipeline, "plan_traced", plain_does_not_fit)
        ahead = autopar.plan(model, (), kw, **request)
        with monkeypatch.context() as m:
            m.setattr(forked, "forks", lambda: False)
            alone = autopar.plan(model, (), kw, **request)
        assert (ahead.pipeline is None) == (alone.pipeline is None) == (not patch)
        assert ahead.total_s == alone.total_s and ahead.fingerprint == alone.fingerprint
        assert [p.fingerprint for p in ahead.stage_plans] == [p.fingerprint for p in alone.stage_plans]
