"""Mean losses as a sum over a count (passes/trace/mean_losses.py): the traced program
computes the model's loss and gradients, ignored targets included; the solver splits a
causal LM's loss rows instead of gathering its logits; the split plan equals one device."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.passes.trace.trace import trace
from autopar.tools.simulated import CHEAP_COMM, simulate_against
from autopar.tools.zoo import LossOnly
from tests import models

aten = torch.ops.aten
LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)


class Classifier(nn.Module):
    """A linear layer and a loss over its rows, called as `kind` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        if self.kind == "mean":
            return F.cross_entropy(logits, target, ignore_index=3)
        if self.kind == "bf16 mean":  # left as it is: aten rounds its float32 sum once, a bf16 sum would round twice
            return F.cross_entropy(logits.bfloat16(), target)
        if self.kind == "nll mean":
            return F.nll_loss(logits.log_softmax(-1), target)
        if self.kind == "weighted":
            return F.cross_entropy(logits, target, weight=torch.arange(1.0, 6.0))
        if self.kind == "smoothed":
            return F.cross_entropy(logits, target, label_smoothing=0.1)
        if self.kind == "probabilities":
            return F.cross_entropy(logits, target.float().softmax(-1))
        return F.cross_entropy(logits, target, reduction="sum")


def _targets(kind: str, ignored: str) -> torch.Tensor:
    if kind == "probabilities":
        return torch.randn(6, 5)
    ignore = 3 if kind == "mean" else -100
    if ignored == "all":
        return torch.full((6,), ignore)
    target = torch.tensor([0, 1, 3, 4, 3, 2])
    return target.masked_fill(target == 3, ignore)


def _loss_calls(traced) -> list:
    return [n for n in traced.gm.graph.nodes if n.target in LOSSES]


@pytest.mark.parametrize("ignored", ["some", "all"])
@pytest.mark.parametrize("kind", ["mean", "nll mean", "weighted", "smoothed", "probabilities", "sum", "bf16 mean"])
def test_the_traced_loss_and_gradients_are_the_models(kind, ignored):
    torch.manual_seed(0)
    model, x = Classifier(kind), torch.randn(6, 8)
    target = _targets(kind, ignored)
    traced = trace(model, (x, target))
    (loss,) = _loss_calls(traced)
    reductions = {loss.args[3] if len(loss.args) > 3 else loss.kwargs.get("reduction", 1)}
    assert reductions == ({2} if kind in ("mean", "nll mean", "sum") else {1}), (kind, loss.args)
    divided = any(n.target is aten.div.Tensor and n.args[0] is loss for n in traced.gm.graph.nodes)
    assert divided == (kind in ("mean", "nll mean"))

    params = dict(model.named_parameters())
    feeds = [params[gi.target] if isinstance(gi.target, str) else (x, target)[gi.target] for gi in traced.inputs]
    got = traced.gm(*feeds)[0]
    want = model(x, target)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)
    if not want.isnan():
        grads = torch.autograd.grad(got, list(params.values()))
        for g, w in zip(grads, torch.autograd.grad(want, list(params.values()))):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_causal_lms_loss_rows_are_split_not_its_logits_gathered():
    # labels with ignored positions (-100, as a padded batch has), links cheap enough that
    # the tiny model is worth splitting, the loss alone returned: the solver computes each
    # rank's rows of the loss (before, the mean ran replicated, on logits gathered whole);
    # one device's loss and every gradient equal
    model = LossOnly(models.build("llama")).train()
    _, kwargs = models.inputs("llama", batch=4, seq=8)
    labels = kwargs["labels"].clone()
    labels[:, -3:] = -100
    kwargs = {**kwargs, "labels": labels}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (), kwargs, mesh=(4,), training=True, device=CHEAP_COMM)
    (loss,) = [n for n in plan.nodes if n.op in {str(t) for t in LOSSES}]
    assert str(loss.inputs[0]) == "S(0)", str(loss)
    assert simulate_against(model, (), kwargs, trace(model, (), kwargs), plan) > 0
