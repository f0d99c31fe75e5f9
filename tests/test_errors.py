"""Bad input fails with a typed error naming the culprit; unknown ops are replicated
with one warning. Offline (no ranks) except where a process group is the point."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.passes.strategies import MissingRuleWarning
from tests.models import MLP


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # torch.export cannot trace a branch on a tensor's value
            return x * 2
        return x


class Flipper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.flip(self.lin(x), [0]).cummax(1).values


def test_untraceable_model_names_model_and_quotes_export():
    with pytest.raises(autopar.TraceError) as err:
        autopar.plan(DataDependent(), (torch.randn(4, 4),), mesh=(2,))
    msg = str(err.value)
    assert "DataDependent" in msg and "torch.export" in msg
    assert "data-dependent" in msg.lower() or "guard" in msg.lower() or "Could not" in msg


def test_op_without_rule_is_replicated_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(Flipper().eval(), (torch.randn(8, 8),), mesh=(2, 2))
    missing = [w for w in caught if issubclass(w.category, MissingRuleWarning)]
    assert len(missing) == 1
    assert "aten.flip.default" in str(missing[0].message) and "aten.cummax.default" in str(missing[0].message)
    assert "aten.flip.default" in plan.unruled_ops
    flip = next(n for n in plan.nodes if n.op == "aten.flip.default")
    assert flip.outputs[0].is_replicated() and all(s.is_replicated() for s in flip.inputs)


@pytest.mark.parametrize("mesh", [(0, 2), (2, -1), (), "2x4", (2.0, 2)])
def test_malformed_mesh_is_refused(mesh):
    with pytest.raises(autopar.MeshError) as err:
        autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=mesh)
    assert "mesh" in str(err.value)


def test_compile_without_process_group_says_how_to_launch():
    with pytest.raises(autopar.ProcessGroupError) as err:
        autopar.compile(MLP().eval(), mesh=(2, 4))
    assert "torchrun" in str(err.value) and "autopar.plan" in str(err.value)


def test_buffer_mutation_is_refused_clearly():
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    with pytest.raises(autopar.UnsupportedModelError) as err:
        autopar.plan(bn, (torch.randn(8, 4),), mesh=(2,))
    assert "running_mean" in str(err.value) or "mutates" in str(err.value)


def test_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError) as err:
        autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=(2,), devcie="h100")
    assert "devcie" in str(err.value)


def test_unknown_device_preset_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=(2,), device="tpu9")
    assert "h100" in str(err.value)
