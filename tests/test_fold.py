"""The rank program's fold (passes/lower/fold.py): export's assertions dropped; attention
masks that are causal by construction run as is_causal=True (made so by the trace,
passes/trace/causal_masks.py), everything else as traced; the programs still equal one
device (lockstep simulator)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.passes.lower.emit import emit
from autopar.passes.trace.causal_masks import is_triangle
from autopar.passes.trace.trace import trace
from autopar.tools.simulated import simulate_against
from tests import models


class Attention(nn.Module):
    """One attention layer whose mask is `kind`: built from aranges (causal, causal
    additive, sliding window) or given by the caller (input)."""

    def __init__(self, kind: str, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        rows = torch.arange(n, device=x.device)
        if self.kind == "causal":
            mask = rows[None, :] <= rows[:, None]
        elif self.kind == "additive":
            mask = torch.zeros(n, n, device=x.device).masked_fill(rows[None, :] > rows[:, None], float("-inf"))
        elif self.kind == "broadcast":  # the 1 x 1 triangle, broadcast: every key visible
            mask = torch.ones(1, 1, dtype=torch.bool, device=x.device).tril()
        elif self.kind == "window":
            mask = (rows[None, :] <= rows[:, None]) & (rows[:, None] - rows[None, :] < 3)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None].expand(b, 1, *mask.shape))
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def _program(model, args, mesh=(2,)):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, args, mesh=mesh, training=True)
    traced = trace(model, args)
    return traced, plan, emit(traced, plan, (0,) * len(mesh))


def _sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]


@pytest.mark.parametrize("kind", ["causal", "additive"])
def test_a_causal_mask_built_from_constants_runs_as_is_causal_and_still_equals_one_device(kind):
    torch.manual_seed(0)
    model, x = Attention(kind).train(), torch.randn(4, 8, 16)
    traced, plan, program = _program(model, (x,))
    (sdpa,) = _sdpa_calls(program.gm)
    assert sdpa.kwargs.get("is_causal") is True and sdpa.args[3:4] in ((), (None,))
    assert "arange" not in program.code and "_assert_tensor_metadata" not in program.code
    assert simulate_against(model, (x,), {}, traced, plan) > 0  # outputs and gradients of every rank


@pytest.mark.parametrize("kind", ["window", "input", "broadcast"])
def test_a_mask_that_is_not_causal_or_not_constant_is_left_as_traced(kind):
    torch.manual_seed(0)
    model, x = Attention(kind).train(), torch.randn(4, 8, 16)
    args = (x, torch.rand(8, 8) > 0.3) if kind == "input" else (x,)
    traced, plan, program = _program(model, args)
    (sdpa,) = _sdpa_calls(program.gm)
    assert not sdpa.kwargs.get("is_causal") and isinstance(sdpa.args[3], torch.fx.Node)
    assert simulate_against(model, args, {}, traced, plan) > 0


def test_llama_rank_programs_build_no_mask_and_assert_nothing():
    """transformers materialises the causal mask while exported (eagerly it passes
    is_causal=True): the rank program rebuilds none of it."""
    model = models.build("llama").train()
    args, kwargs = models.inputs("llama", batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, args, kwargs, mesh=(2, 2), training=True)
    traced = trace(model, args, kwargs)
    program = emit(traced, plan, (1, 0))
    calls = _sdpa_calls(program.gm)
    assert calls and all(c.kwargs.get("is_causal") is True for c in calls)
    assert "_assert_tensor_metadata" not in program.code
    assert simulate_against(model, args, kwargs, traced, plan) > 0


def test_only_the_exact_lower_triangle_is_causal():
    tril = torch.ones(4, 6, dtype=torch.bool).tril()
    assert is_triangle(tril) and is_triangle(tril.expand(2, 3, 4, 6))
    assert not is_triangle(torch.ones(4, 4, dtype=torch.bool).tril(-1))  # diagonal masked
    assert not is_triangle(torch.ones(4, 4, dtype=torch.bool).tril(1))
    mixed = torch.stack([torch.ones(4, 4, dtype=torch.bool).tril(), torch.ones(4, 4, dtype=torch.bool)])
    assert not is_triangle(mixed)  # one leading index differs
    additive = torch.zeros(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    assert is_triangle(additive) and not is_triangle(additive.masked_fill(additive == 0, -1e4))
    assert not is_triangle(tril.to(torch.int64))
