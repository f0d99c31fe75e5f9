"""Options(sharded_outputs=True) in planning (passes/strategies/output_layouts.py): the
output node takes each output in the layout its producer makes, where that is cheaper,
and the plan prices and counts it so. On gloo ranks: tests/test_equivalence.py."""

from __future__ import annotations

import warnings
from functools import cache

import pytest
import torch
from torch import nn

import autopar
from autopar.core.options import Options, OptionsError
from autopar.passes.plan.hand_plans import hand_plan
from autopar.passes.strategies.output_layouts import MAX_CHOICES, outputs_left_split
from autopar.passes.strategies.strategies import annotate
from autopar.passes.trace.trace import trace
from autopar.tools.simulated import CHEAP_COMM
from tests import models


@cache  # a plan is a frozen value: the tests below share each of the two
def _data_parallel(sharded: bool):
    m = models.build("llama").train()
    args, kwargs = models.inputs("llama", 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hand_plan(m, args, kwargs, mesh=(4,), style="data_parallel", device=CHEAP_COMM,
                         sharded_outputs=sharded)


def test_logits_made_split_are_returned_split_with_no_gather_and_a_quarter_of_the_bytes():
    whole, split = _data_parallel(False), _data_parallel(True)
    into = [e for e in split.edges if e.consumer == "output"]
    assert [str(s) for s in split.node("output").inputs] == ["R", "S(0)"]
    assert all(not e.steps for e in into), [str(s) for e in into for s in e.steps]
    gathered = [e for e in whole.edges if e.consumer == "output" and e.steps]
    assert [s.kind.value for e in gathered for s in e.steps] == ["all_gather"]
    logits = whole.node("output").inputs[1]
    full = logits.local_nbytes((4,))
    assert whole.activation_bytes - split.activation_bytes == full - full // 4
    assert split.comm_s < whole.comm_s


def test_the_loss_beside_split_logits_needs_no_gradient_sum():
    # the output node computes nothing: a whole loss returned beside a split output is
    # seeded by each rank's caller, not summed over the axis that splits the logits
    split = _data_parallel(True)
    (loss_edge,) = [e for e in split.edges if e.consumer == "output" and e.position == 0]
    assert loss_edge.steps == () and loss_edge.comm_s == 0.0


class _Many(nn.Module):
    def forward(self, x):
        return tuple(x[:, : 2 ** k] * 2 for k in range(1, 7))


def test_many_outputs_keep_the_largest_free_within_the_cap():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(_Many(), (torch.randn(8, 64),))
    graph = outputs_left_split(annotate(traced, autopar.Mesh.of((2, 2))))
    (output,) = [n for n in graph.nodes if n.name == "output"]
    assert 1 < len(output.strategies) <= MAX_CHOICES
    free = [len({s.inputs[i] for s in output.strategies}) for i in range(6)]
    assert free[-1] > 1 and free[0] == 1 and free == sorted(free), free


@pytest.mark.parametrize("kw, says", [(dict(pipeline_axis=0), "pipeline"), (dict(dynamic=True), "dynamic")])
def test_sharded_outputs_with_a_pipeline_or_dynamic_shapes_is_refused(kw, says):
    with pytest.raises(OptionsError, match=f"sharded_outputs=True.*{says}"):
        Options(sharded_outputs=True, **kw)


def test_generation_with_sharded_outputs_is_refused_before_planning():
    with pytest.raises(OptionsError, match="generation with sharded_outputs=True"):
        autopar.plan_for_generation(models.build("llama"), mesh=(2,), max_cache_len=16, sharded_outputs=True)


class _Split:
    """Stands in for a DTensor output: what the step's check looks for is full_tensor."""

    def full_tensor(self) -> torch.Tensor:
        return torch.zeros(1)


def test_a_step_with_loss_fn_refuses_outputs_returned_split():
    from autopar.runtime.step import one_program_step
    with pytest.raises(OptionsError, match="returns some split, as DTensors"):
        one_program_step(lambda: (torch.ones(1), _Split()), lambda out, target: out[0].sum(), (), {}, None)
