"""Pipeline stages planned from a short model (passes/plan/stage_sample.py): each stage's
stretched graph is the trace of the whole model's stage module, node for node, and a model
whose stages do not stretch is planned from the whole split."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.core.pipeline import PipelinePlan, Schedule, Stage
from autopar.passes.plan import pipeline_stages
from autopar.passes.plan.pipeline_stages import own_inputs, split_stages, stage_inputs
from autopar.passes.plan.planning import trace_for_planning
from autopar.passes.plan.stage_sample import KeptBlocks, short_model, stage_graph, stage_sample
from autopar.passes.trace.stretch import SAMPLE
from autopar.tools.simulated import CHEAP_COMM
from tests.models import build, inputs
from tests.test_stretch import _Counting, _Skipping

SLOW = pytest.mark.slow
BOUNDS = ((0, 6), (6, 11), (11, 14))  # the middle stage: one copied block; the last: none (kept whole)


def _pipeline(container: str, bounds=BOUNDS, schedule: Schedule = Schedule.ONE_F_ONE_B) -> PipelinePlan:
    stages = tuple(Stage(k, k, first, stop, 0.0, 0, 0.0) for k, (first, stop) in enumerate(bounds))
    return PipelinePlan(0, 2, schedule, container, bounds[-1][1], stages, 0.0, 0.0)


def _model(family: str, layers: int = BOUNDS[-1][1]):
    warnings.simplefilter("ignore")
    depth = {"n_layer": layers} if family == "gpt2" else {"num_hidden_layers": layers}
    return build(family, **depth).train(), inputs(family, batch=2)[1]


def _stage_traces(split, pipeline, kwargs, dtype=None):
    out = []
    for stage in pipeline.stages:
        args, kw = stage_inputs(split, stage.index, (), kwargs)
        out.append(trace_for_planning(split.modules[stage.index], own_inputs(split, stage.index, args), kw, dtype))
    return out


def _module_paths(traced):
    return [(n.name, [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()])
            for n in traced.gm.graph.nodes]


# gpt2: tied embedding and head in the first and last stages; deepseek_v3: a dense first layer
# (kept whole in the first stage) before its expert layers; interleaved: every stage relays
# what later stages read (the rotary tables)
INTERLEAVED = Schedule.INTERLEAVED_1F1B


@pytest.mark.parametrize("family,container,dtype,schedule", [
    ("llama", "model.layers", None, None), pytest.param("llama", "model.layers", torch.bfloat16, None, marks=SLOW),
    pytest.param("llama", "model.layers", None, INTERLEAVED, marks=SLOW),
    pytest.param("gpt2", "transformer.h", None, None, marks=SLOW),
    pytest.param("deepseek_v3", "model.layers", None, None, marks=SLOW)])
def test_each_stretched_stage_graph_is_the_whole_splits_stage_trace(family, container, dtype, schedule):
    model, kwargs = _model(family)
    if schedule is INTERLEAVED:  # a model input read by two stages: torch's interleaved schedule cannot pass it
        kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
    pipeline = _pipeline(container, schedule=schedule or Schedule.ONE_F_ONE_B)
    sample = stage_sample(model, pipeline)
    first = 1 if family == "deepseek_v3" else 0
    assert sample.kept == (*range(first + 3), 5, 6, 7, 8, 10, 11, 12, 13)
    assert [s is None for s in sample.spans] == [False, False, True]
    whole = _stage_traces(split_stages(model, (), kwargs, pipeline, True, dtype), pipeline, kwargs, dtype)
    with short_model(model, sample):
        short = _stage_traces(split_stages(model, (), kwargs, pipeline, True, dtype), pipeline, kwargs, dtype)
    assert isinstance(model.get_submodule(container), nn.ModuleList) and len(model.get_submodule(container)) == 14
    for k, (made, real) in enumerate(zip(short, whole)):
        if sample.spans[k] is not None:
            assert len(made.gm.graph.nodes) < len(real.gm.graph.nodes)
        made = stage_graph(made, sample.spans[k], k)
        assert made.fingerprint == real.fingerprint  # ops, wiring, names, shapes and dtypes
        assert made.inputs == real.inputs  # state-dict names, kinds and order
        assert _module_paths(made) == _module_paths(real)
        assert made.gm.code == real.gm.code


def test_no_stage_deeper_than_the_sample_keeps_the_whole_split():
    model, _ = _model("llama", 8)
    assert stage_sample(model, _pipeline("model.layers", ((0, 4), (4, 8)))) is None
    assert stage_sample(model, _pipeline("model.layers", ((0, 5), (5, 8)))) is not None


def test_kept_blocks_index_and_slice_by_position():
    blocks = [nn.Linear(2, 2) for _ in range(6)]
    kept = KeptBlocks.of({str(k): blocks[k] for k in (0, 1, 4, 5)})
    assert [name for name, _ in kept.named_children()] == ["0", "1", "4", "5"]
    assert kept[2] is blocks[4] and kept[-1] is blocks[5] and list(kept[1:3]) == [blocks[1], blocks[4]]
    assert [name for name, _ in kept[1:3].named_children()] == ["1", "4"]
    with pytest.raises(IndexError):
        kept[4]
    with pytest.raises(TypeError):
        kept.append(nn.Linear(2, 2))


def test_a_container_subclass_keeps_the_whole_split():
    """A subclass's own forward would be lost in the short model."""
    class Residual(nn.Sequential):
        def forward(self, x):
            for block in self:
                x = x + block(x)
            return x
    model = nn.Sequential(Residual(*(nn.Linear(4, 4) for _ in range(12))))
    assert stage_sample(model, _pipeline("0", ((0, 6), (6, 12)))) is None


def _pipelined_plan(model, kwargs):
    return autopar.plan(model, (), kwargs, mesh=(2, 2), pipeline_axis=0, microbatches=2, device=CHEAP_COMM)


@pytest.mark.slow
def test_a_plan_from_the_short_split_is_the_plan_from_the_whole_split(monkeypatch):
    model, kwargs = _model("llama")
    splits = []
    real = pipeline_stages.split_stages
    monkeypatch.setattr(pipeline_stages, "split_stages",
                        lambda m, *a: splits.append(len(m.model.layers)) or real(m, *a))
    short = _pipelined_plan(model, kwargs)
    monkeypatch.setattr(pipeline_stages, "stage_sample", lambda *a: None)
    whole = _pipelined_plan(model, kwargs)
    assert len(splits) == 2 and splits[0] < 14 and splits[1] == 14  # the short split planned them: no fallback
    assert short.digest() == whole.digest()
    assert [p.fingerprint for p in short.stage_plans] == [p.fingerprint for p in whole.stage_plans]


# _Counting indexes its blocks by the configured depth (the short model does not run);
# _Skipping's blocks read two blocks back (the stages do not stretch)
@pytest.mark.parametrize("kind", [_Counting, _Skipping])
def test_stages_that_do_not_stretch_are_planned_from_the_whole_split(kind, monkeypatch):
    model, x = kind(depth=12), torch.randn(4, 8)
    splits = []
    real = pipeline_stages.split_stages
    monkeypatch.setattr(pipeline_stages, "split_stages", lambda m, *a: splits.append(len(m.layers)) or real(m, *a))
    plan = autopar.plan(model, (x,), {}, mesh=(2,), pipeline_axis=0, microbatches=2)
    assert plan.pipeline is not None and len(plan.stage_plans) == 2
    assert splits == [2 * SAMPLE, 12]  # the short model's split first (refused, or its stages not stretching)
