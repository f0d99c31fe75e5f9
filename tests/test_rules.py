"""Rule tests: strategy counts, and every strategy of every rule reproduces the op's
single-device output when run shard by shard (passes/rules/blockwise.py) on (2, 2) and (1, 4)."""

from __future__ import annotations

import pytest
import torch

from autopar.core.placement import P, Partial, R, Shard
from autopar.passes.rules import expand, rule_for
from autopar.passes.rules.blockwise import op_call_of, run_sharded

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def ints(high, *shape):
    return torch.randint(0, high, shape, generator=g)


CASES = {
    "embedding_padding": (aten.embedding.default, (rnd(8, 4), torch.tensor([[0, 7, 3], [5, 1, 6]]), 5), {}),
    # mixture of experts: 6 routed rows over 3 experts (cumulative row offsets 2, 4, 6)
    "grouped_mm": (aten._grouped_mm.default, (rnd(6, 16), rnd(3, 16, 16), torch.tensor([2, 4, 6], dtype=torch.int32)),
                   {}),
    "index_put_rows": (aten.index_put.default, (rnd(6, 8), [torch.tensor([4, 0, 2])], rnd(3, 8)), {}),
    "min_other": (aten.min.other, (rnd(4, 4), rnd(4)), {}),
    "copy": (aten.copy.default, (rnd(4, 4), rnd(4)), {}),
    "fill_tensor": (aten.fill.Tensor, (rnd(4, 4), torch.tensor(3.0)), {}),
    "conv2d": (aten.conv2d.default, (rnd(4, 4, 6, 6), rnd(8, 4, 3, 3), rnd(8), [1, 1], [1, 1]), {}),
    "conv2d_nobias": (aten.conv2d.default, (rnd(4, 4, 6, 6), rnd(8, 4, 3, 3)), {}),
    "conv2d_groups": (aten.conv2d.default, (rnd(4, 4, 6, 6), rnd(8, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], 2), {}),
    "conv1d": (aten.conv1d.default, (rnd(4, 4, 8), rnd(8, 4, 3), rnd(8)), {}),
    "max_pool2d": (aten.max_pool2d.default, (rnd(4, 4, 8, 8), [2, 2]), {}),
    "avg_pool2d": (aten.avg_pool2d.default, (rnd(4, 4, 8, 8), [3, 3], [1, 1], [1, 1]), {}),
    "adaptive_avg_pool2d": (aten.adaptive_avg_pool2d.default, (rnd(4, 4, 8, 8), [1, 1]), {}),
    "batch_norm_eval": (aten.batch_norm.default, (rnd(4, 4, 6, 6), rnd(4), rnd(4), rnd(4), rnd(4).abs() + 0.5,
                                                  False, 0.1, 1e-5, False), {}),
    "batch_norm_batch_stats": (aten.batch_norm.default, (rnd(4, 4, 6, 6), rnd(4), rnd(4), None, None, True, 0.1,
                                                         1e-5, False), {}),
    "weight_norm": (aten._weight_norm.default, (rnd(8, 4, 6), rnd(1, 1, 6), 2), {}),
    "weight_norm_dim0": (aten._weight_norm.default, (rnd(8, 4, 6), rnd(8, 1, 1), 0), {}),
    "group_norm": (aten.group_norm.default, (rnd(4, 4, 6, 6), 2, rnd(4), rnd(4), 1e-5, False), {}),
    "mm": (aten.mm.default, (rnd(4, 8), rnd(8, 4)), {}),
    "addmm": (aten.addmm.default, (rnd(4), rnd(8, 4), rnd(4, 4)), {}),
    "bmm": (aten.bmm.default, (rnd(2, 4, 8), rnd(2, 8, 4)), {}),
    "linear": (aten.linear.default, (rnd(2, 4, 8), rnd(4, 8), rnd(4)), {}),
    "linear_nobias": (aten.linear.default, (rnd(2, 4, 8), rnd(4, 8)), {}),
    "matmul": (aten.matmul.default, (rnd(2, 4, 8), rnd(8, 4)), {}),
    "add_bcast": (aten.add.Tensor, (rnd(2, 4, 8), rnd(8)), {}),
    "add_scalar": (aten.add.Tensor, (rnd(4, 4), 1.0), {}),
    "sub": (aten.sub.Tensor, (rnd(4, 4), rnd(4, 4)), {}),
    "mul": (aten.mul.Tensor, (rnd(2, 4, 4), rnd(1, 4, 1)), {}),
    "mul_scalar": (aten.mul.Tensor, (rnd(4, 4), 0.5), {}),
    "div": (aten.div.Tensor, (rnd(4, 4), rnd(4, 4).abs() + 1), {}),
    "where": (aten.where.self, (rnd(4, 4) > 0, rnd(4, 4), rnd(4)), {}),
    "masked_fill": (aten.masked_fill.Scalar, (rnd(2, 4, 4), rnd(4, 4) > 0, -1e4), {}),
    "gelu": (aten.gelu.default, (rnd(4, 8),), {}),
    "neg": (aten.neg.default, (rnd(4, 8),), {}),
    "to_dtype": (aten.to.dtype, (rnd(4, 8), torch.float64), {}),
    "dropout_eval": (aten.dropout.default, (rnd(4, 8), 0.1, False), {}),
    "view_merge": (aten.view.default, (rnd(2, 4, 8), [8, 8]), {}),
    "view_split": (aten.view.default, (rnd(8, 8), [2, 4, 2, 4]), {}),
    "reshape_heads": (aten.reshape.default, (rnd(2, 4, 8), [2, 4, 2, 4]), {}),
    "transpose": (aten.transpose.int, (rnd(2, 4, 8), 1, 2), {}),
    "permute": (aten.permute.default, (rnd(2, 4, 8), [2, 0, 1]), {}),
    "t": (aten.t.default, (rnd(4, 8),), {}),
    "expand": (aten.expand.default, (rnd(2, 1, 8), [2, 4, 8]), {}),
    "unsqueeze": (aten.unsqueeze.default, (rnd(4, 8), 1), {}),
    "squeeze": (aten.squeeze.dim, (rnd(4, 1, 8), 1), {}),
    "slice": (aten.slice.Tensor, (rnd(4, 8), 1, 0, 4), {}),
    "slice_full": (aten.slice.Tensor, (rnd(4, 8), 1, 0, 2**62), {}),
    "select": (aten.select.int, (rnd(4, 8), 0, 1), {}),
    "slice_scatter": (aten.slice_scatter.default, (rnd(4, 4, 8), rnd(4, 4, 4), 2, 0, 4), {}),
    "slice_scatter_all": (aten.slice_scatter.default, (rnd(4, 8), rnd(4, 8), 1), {}),
    "select_scatter": (aten.select_scatter.default, (rnd(4, 4, 8), rnd(4, 8), 1, 2), {}),
    "select_scatter_unit": (aten.select_scatter.default, (rnd(4, 1, 8), rnd(4, 8), 1, 0), {}),
    "split": (aten.split.Tensor, (rnd(4, 8), 4, 1), {}),
    "cat": (aten.cat.default, ([rnd(4, 4), rnd(4, 4)], 1), {}),
    "stack": (aten.stack.default, ([rnd(4, 4), rnd(4, 4)], 0), {}),
    "contiguous": (aten.contiguous.default, (rnd(4, 8),), {}),
    "sum": (aten.sum.dim_IntList, (rnd(4, 8), [1], False), {}),
    "sum_keep": (aten.sum.dim_IntList, (rnd(4, 8), [0], True), {}),
    "mean": (aten.mean.dim, (rnd(4, 8), [-1], True), {}),
    "amax": (aten.amax.default, (rnd(4, 8), [1], False), {}),
    "softmax": (aten._softmax.default, (rnd(4, 8), -1, False), {}),
    "log_softmax": (aten._log_softmax.default, (rnd(4, 8), 1, False), {}),
    "layer_norm": (aten.layer_norm.default, (rnd(2, 4, 8), [8], rnd(8), rnd(8), 1e-5), {}),
    "rms_norm": (aten.rms_norm.default, (rnd(2, 4, 8), [8], rnd(8), 1e-6), {}),
    "sdpa": (aten.scaled_dot_product_attention.default, (rnd(2, 4, 4, 8), rnd(2, 4, 4, 8), rnd(2, 4, 4, 8)), {}),
    "sdpa_mask": (aten.scaled_dot_product_attention.default,
                  (rnd(2, 4, 4, 8), rnd(2, 4, 4, 8), rnd(2, 4, 4, 8), rnd(2, 1, 4, 4) > -1), {}),
    "sdpa_causal": (aten.scaled_dot_product_attention.default,
                    (rnd(2, 4, 4, 8), rnd(2, 4, 4, 8), rnd(2, 4, 4, 8)), {"is_causal": True}),
    "sdpa_gqa": (aten.scaled_dot_product_attention.default,
                 (rnd(2, 4, 4, 8), rnd(2, 2, 4, 8), rnd(2, 2, 4, 8)), {"enable_gqa": True}),
    "sdpa_causal_gqa": (aten.scaled_dot_product_attention.default,
                        (rnd(2, 4, 8, 8), rnd(2, 2, 8, 8), rnd(2, 2, 8, 8)), {"is_causal": True, "enable_gqa": True}),
    # more keys than query rows: torch's top-left alignment; rows split only in self-attention
    "sdpa_causal_wide": (aten.scaled_dot_product_attention.default,
                         (rnd(2, 4, 4, 8), rnd(2, 4, 12, 8), rnd(2, 4, 12, 8), None, 0.0, True), {}),
    "embedding": (aten.embedding.default, (rnd(16, 8), ints(16, 2, 4)), {}),
    "cross_entropy_mean": (aten.cross_entropy_loss.default, (rnd(8, 16), ints(16, 8)), {}),
    "cross_entropy_sum": (aten.cross_entropy_loss.default, (rnd(8, 16), ints(16, 8), None, 2), {}),
    "cross_entropy_none": (aten.cross_entropy_loss.default, (rnd(8, 16), ints(16, 8), None, 0), {}),
    "cumsum": (aten.cumsum.default, (rnd(4, 8), 1), {}),
    "gather": (aten.gather.default, (rnd(4, 8), 1, ints(8, 4, 8)), {}),
    "pad": (aten.pad.default, (rnd(4, 8), [1, 1]), {}),
}


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_strategy_reproduces_the_op(name, mesh):
    target, args, kwargs = CASES[name]
    rule = rule_for(target)
    assert rule is not None, f"no rule registered for {target}"
    call, _ = op_call_of(target, args, kwargs)
    strategies = expand(rule(call), call, mesh)
    assert strategies, "a rule must offer at least the replicated strategy"
    expected = target(*args, **kwargs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    for i, s in enumerate(strategies):
        got = run_sharded(target, args, kwargs, s, mesh, seed=i)
        assert len(got) == len(expected), f"{name} under {s}: {len(got)} outputs, the op gives {len(expected)}"
        for e, o in zip(expected, got):
            torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} under {s}: {m}")


def _count(name, mesh=(2, 2)):
    target, args, kwargs = CASES[name]
    call, _ = op_call_of(target, args, kwargs)
    return expand(rule_for(target)(call), call, mesh)


def test_transformers_grouped_mm_fallback_has_the_grouped_mm_rule():
    from transformers.integrations import moe  # noqa: F401 - registers the op
    op = torch.ops.transformers.grouped_mm_fallback.default
    args = (rnd(6, 4), rnd(3, 4, 8), torch.tensor([2, 4, 6], dtype=torch.int32))
    call, _ = op_call_of(op, args, {})
    rules = rule_for(op)(call)
    assert len(rules) == 5
    expected = op(*args)
    for i, s in enumerate(expand(rules, call, (2, 2))):
        torch.testing.assert_close(run_sharded(op, args, {}, s, (2, 2), seed=i)[0], expected, rtol=1e-5, atol=1e-5)


def test_mm_strategy_count():
    # per axis: RR->R, PR->P, RP->P, S0R->S0, RS1->S1, S1S0->P = 6; on (2,2) every pair
    # fits (4x8 @ 8x4 splits evenly), so 6 * 6 = 36
    assert len(_count("mm")) == 36


def test_one_axis_mesh_has_only_replicated_strategies():
    assert [str(s) for s in _count("mm", (1, 1))] == ["(RR,RR)->RR"]


def test_softmax_never_splits_its_dim():
    for s in _count("softmax"):
        assert Shard(1) not in s.inputs[0].placements


def test_gqa_heads_split_only_when_kv_heads_divide():
    # 2 kv heads cannot split 4 ways: on (1, 4) no head-sharded strategy exists
    heads = [s for s in _count("sdpa_gqa", (1, 4)) if Shard(1) in s.outputs[0].placements]
    assert heads == []
    assert any(Shard(1) in s.outputs[0].placements for s in _count("sdpa_gqa", (2, 2)))


def test_causal_attention_splits_query_rows_with_keys_whole():
    # context parallelism: every rank's rows against all keys, its own offset mask
    # (test_every_strategy_reproduces_the_op checks each block's result)
    rows = [s for s in _count("sdpa_causal", (1, 4)) if s.outputs[0].placements == (R, Shard(2))]
    assert rows and all(s.inputs[1].placements == (R, R) for s in rows)
    assert any(s.outputs[0].placements == (Shard(2), Shard(2)) for s in _count("sdpa_causal_gqa"))
    # with more keys than queries a block's start could not be read off the keys' length
    assert all(Shard(2) not in s.outputs[0].placements for s in _count("sdpa_causal_wide"))


@pytest.mark.parametrize("rows", [7, 10])
def test_causal_rows_split_unevenly_are_exact(rows):
    # 7 or 10 query rows over 4 ranks: torch.chunk blocks of 2 or 3, the last one short
    q, k, v = rnd(1, 2, rows, 8), rnd(1, 2, rows, 8), rnd(1, 2, rows, 8)
    op = aten.scaled_dot_product_attention.default
    call, _ = op_call_of(op, (q, k, v), {"is_causal": True})
    split = [s for s in expand(rule_for(op)(call), call, (4,), uneven=True) if s.outputs[0].placements == (Shard(2),)]
    assert len(split) == 1
    torch.testing.assert_close(run_sharded(op, (q, k, v), {"is_causal": True}, split[0], (4,))[0],
                               op(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


def test_mean_gives_average_partial_and_sum_gives_sum_partial():
    assert any(s.outputs[0].placements == (Partial("avg"), R) for s in _count("mean"))
    assert any(s.outputs[0].placements == (P, R) for s in _count("sum"))


def test_add_with_scalar_is_not_linear():
    assert all(not isinstance(p, Partial) for s in _count("add_scalar") for p in s.outputs[0].placements)


class _SqueezeAll(torch.nn.Module):
    """`squeeze()` with no dims over a batch split to one row per rank: locally the batch
    dim has size 1 too, and must survive."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(x).squeeze() * 2.0


def test_squeeze_without_dims_keeps_a_dim_split_to_one_element_per_rank():
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.passes.trace.trace import trace
    from autopar.tools.simulated import CHEAP_COMM, simulate_against
    model, x = _SqueezeAll().eval(), torch.randn(4, 8)
    traced = trace(model, (x,))
    plan = plan_traced(traced, Mesh((4,)), Options(device=CHEAP_COMM))[1]
    squeeze = next(n for n in plan.nodes if n.name.startswith("squeeze"))
    assert squeeze.outputs[0].placements == (Shard(0),), "the test needs the batch split four ways"
    simulate_against(model, (x,), {}, traced, plan)


@pytest.mark.parametrize("name", ["slice_scatter", "slice_scatter_all", "select_scatter", "select_scatter_unit"])
def test_write_rules_offer_every_layout_discovery_verifies(name):
    """The hand rules of the slice/select writes replaced discovery (which tried ~80
    candidates per call, for every step of a recurrent loop): they must not lose a
    layout the experiment finds."""
    from autopar.passes.strategies.discovery import _discover
    target, args, kwargs = CASES[name]
    call, _ = op_call_of(target, args, kwargs)
    missing = set(_discover(call)) - set(rule_for(target)(call))
    assert not missing, f"{name}: discovery verifies {missing}, the rule does not offer them"
