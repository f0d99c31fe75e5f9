"""Every model family of the zoo, and the tests' CNNs, in the quick set: compiled for a
4-way mesh and run in the in-process mesh simulator against the single-device model
(outputs and, in training, every parameter gradient at assert_close's fp32 defaults).

The plan is made with nearly free communication (tests/cases.py CHEAP_COMM), so the
solver shards everything its rules allow. A 1-D mesh keeps the ILP small (a second
or less per model); the (2, 4) mesh on 8 real gloo ranks is tests/test_zoo.py (slow)."""

from __future__ import annotations

import warnings

import pytest
import torch

from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from autopar.tools import zoo
from tests import cases, models
from autopar.tools.simulated import simulate_against

MESH = (4,)
TINY = [n for n in zoo.names() if n.endswith("-tiny")]
CNNS = {"resnet-group": True, "resnet-batch": False}  # BatchNorm: inference only (running statistics)


def test_every_family_has_a_tiny_model():
    assert {zoo.ZOO[n]["family"] for n in TINY} == set(zoo.FAMILIES)


def _build(name: str) -> tuple:
    if name in CNNS:
        torch.manual_seed(0)
        model = models.TinyResNet(name.removeprefix("resnet-")).train(CNNS[name])
        return model, (torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)),), {}
    return zoo.build(name, batch=4, seq=8, training=True)


@pytest.mark.parametrize("name", TINY + list(CNNS))
def test_zoo_model_matches_single_device_in_simulation(name):
    model, args, kwargs = _build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, args, kwargs)
        plan = plan_traced(traced, Mesh(MESH), Options(device=cases.CHEAP_COMM))[1]
    sharded = [n.name for n in plan.nodes if n.kind is NodeKind.PARAMETER and not n.outputs[0].is_replicated()]
    assert sharded, f"{name}: nothing was sharded, so the simulator would check a replicated program"
    compared = simulate_against(model, args, kwargs, traced, plan, context=f"{name} on {MESH}")
    assert compared > 0 or not traced.training, f"{name}: no gradients compared"
