"""A graph of L alike blocks built from the trace of its first four (passes/trace/stretch.py):
the same graph as tracing all L, node for node, and refused where the sample does not
stand for the rest."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan.planner import plan_graph
from autopar.passes.trace import stretch
from autopar.passes.trace.stretch import SAMPLE, BlockSample, alike_blocks, cut, stretched_graph, stretched_trace
from autopar.passes.trace.trace import trace
from autopar.tools.simulated import CHEAP_COMM
from tests.models import build, inputs

LAYERS = 7


def _model(family: str, **over):
    warnings.simplefilter("ignore")
    depth = {"n_layer": LAYERS} if family == "gpt2" else {"num_hidden_layers": LAYERS}
    return build(family, **depth, **over).train(), inputs(family, batch=2)[1]


def _sample_trace(model, kwargs):
    sample = alike_blocks(model, after_unlike=True)
    with cut(model, sample):
        return sample, trace(model, (), kwargs)


def _module_paths(traced):
    return [(n.name, [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()])
            for n in traced.gm.graph.nodes]


SLOW = pytest.mark.slow


# mixtral, qwen3_moe: routed experts (one body per layer, named by its code); deepseek_v3:
# a dense first layer before its expert layers (the sample starts after it)
@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=SLOW), pytest.param("bert", marks=SLOW),
                                    pytest.param("mixtral", marks=SLOW), pytest.param("qwen3_moe", marks=SLOW),
                                    pytest.param("deepseek_v3", marks=SLOW)])
def test_the_stretched_graph_is_the_whole_trace(family):
    model, kwargs = _model(family)
    whole = trace(model, (), kwargs)
    sample, short = _sample_trace(model, kwargs)
    assert sample.first == (1 if family == "deepseek_v3" else 0)
    assert len(short.gm.graph.nodes) < len(whole.gm.graph.nodes)
    made = stretched_graph(short, sample)
    assert made is not None
    assert made.fingerprint == whole.fingerprint  # ops, wiring, names, shapes and dtypes
    assert made.inputs == whole.inputs  # state-dict names, kinds and order
    assert _module_paths(made) == _module_paths(whole)  # what block clustering reads
    assert made.gm.code == whole.gm.code


@pytest.mark.slow
def test_a_mixed_precision_trace_stretches_with_each_blocks_casts():
    """Options.param_dtype: the trace's wrapper casts each parameter outside every module;
    a block's casts are its own, so the copies cast their own parameters."""
    model, kwargs = _model("llama")
    whole = trace(model, (), kwargs, torch.bfloat16)
    sample = alike_blocks(model)
    with cut(model, sample):
        short = trace(model, (), kwargs, torch.bfloat16)
    made = stretched_graph(short, sample)
    assert made is not None and made.fingerprint == whole.fingerprint and made.gm.code == whole.gm.code


@pytest.mark.slow
def test_autopar_plan_stretches_and_plans_as_from_the_whole_trace(monkeypatch):
    model, kwargs = _model("llama")
    whole = plan_graph(trace(model, (), kwargs), Mesh.of((2, 2)), Options(device=CHEAP_COMM))
    made = []
    monkeypatch.setattr(stretch, "stretched_graph", lambda *a: made.append(stretched_graph(*a)) or made[-1])
    assert autopar.plan(model, (), kwargs, mesh=(2, 2), device=CHEAP_COMM).digest() == whole.digest()
    assert len(made) == 1 and made[0] is not None


def test_a_model_that_returns_every_blocks_output_is_traced_whole():
    model, kwargs = _model("llama")
    kwargs = dict(kwargs, output_hidden_states=True)
    sample, short = _sample_trace(model, kwargs)
    assert stretched_graph(short, sample) is None
    assert stretched_trace(model, (), kwargs).fingerprint == trace(model, (), kwargs).fingerprint


class _Skipping(nn.Module):
    """Each block reads the outputs of the two blocks before it."""

    def __init__(self, width: int = 8, depth: int = LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        before, now = x, x
        for layer in self.layers:
            before, now = now, torch.tanh(layer(now)) + before
        return now.sum()


def test_blocks_that_read_two_blocks_back_are_traced_whole():
    model, x = _Skipping(), torch.randn(4, 8)
    with cut(model, alike_blocks(model)):
        short = trace(model, (x,))
    assert stretched_graph(short, BlockSample("layers", LAYERS)) is None
    assert stretched_trace(model, (x,), {}).fingerprint == trace(model, (x,)).fingerprint


class _Counting(nn.Module):
    """A forward that needs all its blocks: it indexes them by the configured depth."""

    def __init__(self, depth: int = LAYERS) -> None:
        super().__init__()
        self.depth = depth
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))

    def forward(self, x):
        for i in range(self.depth):
            x = torch.relu(self.layers[i](x))
        return x.sum()


def test_a_forward_that_needs_every_block_is_traced_whole():
    model, x = _Counting(), torch.randn(4, 8)
    assert alike_blocks(model).blocks == LAYERS > SAMPLE
    assert stretched_trace(model, (x,), {}).fingerprint == trace(model, (x,)).fingerprint


def test_a_model_no_deeper_than_the_sample_is_traced_as_it_is():
    model, kwargs = build("llama", num_hidden_layers=SAMPLE).train(), inputs("llama", batch=2)[1]
    assert alike_blocks(model) is None
    assert stretched_trace(model, (), kwargs).fingerprint == trace(model, (), kwargs).fingerprint


class _Residual(nn.Module):
    def forward(self, x):
        return torch.tanh(x) + x


class _Stateless(nn.Module):
    """A projection, then blocks without parameters or buffers."""

    def __init__(self, depth: int = LAYERS) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_Residual() for _ in range(depth))

    def forward(self, x):
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_blocks_without_state_stretch():
    """The copies of a block without state have no placeholders of their own."""
    model, x = _Stateless(), torch.randn(4, 8)
    sample = alike_blocks(model)
    with cut(model, sample):
        short = trace(model, (x,))
    made = stretched_graph(short, sample)
    whole = trace(model, (x,))
    assert made is not None and made.fingerprint == whole.fingerprint and made.gm.code == whole.gm.code
