"""Rule discovery (passes/strategies/discovery.py): what it finds must be what a careful person would
write, and what it must not find it never proposes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar.core.placement import Partial, Replicate, Shard, TensorMeta
from autopar.passes.strategies import discovery
from autopar.passes.rules import expand, rule_for
from autopar.passes.rules.blockwise import op_call_of, run_sharded

aten = torch.ops.aten


def _comparable(rules) -> set:
    """Discovery speaks R, S(d) and P(sum); hand rules may also offer P(avg) / P(max)."""
    return {r for r in rules if all(not isinstance(p, Partial) or p.reduce == "sum" for p in r.inputs + r.outputs)}


HAND_RULED = [
    ("mm", aten.mm.default, (torch.randn(4, 6), torch.randn(6, 8)), {}),
    ("add with broadcast", aten.add.Tensor, (torch.randn(4, 6), torch.randn(6)), {}),
    ("mul", aten.mul.Tensor, (torch.randn(4, 6), torch.randn(4, 6)), {}),
    ("softmax", aten._softmax.default, (torch.randn(4, 6), -1, False), {}),
    ("sum over a dim", aten.sum.dim_IntList, (torch.randn(4, 6), [1]), {}),
    ("bmm", aten.bmm.default, (torch.randn(2, 4, 6), torch.randn(2, 6, 8)), {}),
]


@pytest.mark.parametrize("name,target,args,kwargs", HAND_RULED, ids=[c[0] for c in HAND_RULED])
def test_discovery_finds_the_hand_written_rules(name, target, args, kwargs):
    call, _ = op_call_of(target, args, kwargs)
    found = discovery.discover(call)
    assert found is not None
    assert _comparable(found) == _comparable(rule_for(target)(call)), name


TRICKY = [
    # (op, args, the dims that must never be split on input 0 with a split output)
    ("cumsum along dim 1", aten.cumsum.default, (torch.randn(4, 6), 1), {1}),
    ("sort along dim 1", aten.sort.default, (torch.randn(4, 6), 1), {1}),
    ("topk along dim 1", aten.topk.default, (torch.randn(4, 6), 2, 1), {1}),
    ("flip dim 0", aten.flip.default, (torch.randn(4, 6), [0]), {0}),
    ("roll along dim 1", aten.roll.default, (torch.randn(4, 6), [1], [1]), {1}),
    ("cummax along dim 0", aten.cummax.default, (torch.randn(4, 6), 0), {0}),
    ("logcumsumexp along dim 1", aten.logcumsumexp.default, (torch.randn(4, 6), 1), {1}),
    ("argsort along dim 0", aten.argsort.default, (torch.randn(4, 6), 0), {0}),
    ("median along dim 1", aten.median.dim, (torch.randn(4, 6), 1), {1}),
]


@pytest.mark.parametrize("name,target,args,bad_dims", TRICKY, ids=[c[0] for c in TRICKY])
def test_discovery_never_proposes_a_wrong_rule(name, target, args, bad_dims):
    call, tensors = op_call_of(target, args, {})
    found = discovery.discover(call)
    assert found, f"{name}: at least replication"
    for rule in found:
        p = rule.inputs[0]
        assert not (isinstance(p, Shard) and p.dim in bad_dims), f"{name}: proposed {rule}"
        if isinstance(p, Partial):  # a partial sum passes only through linear ops
            assert target in (aten.flip.default, aten.roll.default, aten.cumsum.default), f"{name}: proposed {rule}"
    # and every rule it proposes holds on fresh data at another shard count
    fresh = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9)) for t in tensors]
    full = target(*fresh, *args[1:])
    full = list(full) if isinstance(full, (tuple, list)) else [full]
    for rule in found:
        for n in (2, 4):
            for strategy in expand([rule], call, (n,)):
                got = run_sharded(target, (fresh[0],) + tuple(args[1:]), {}, strategy, (n,), seed=5)
                for g, w in zip(got, full):
                    torch.testing.assert_close(g, w, msg=lambda m: f"{name} {rule} on {n}: {m}")


def test_the_splits_that_do_hold_are_found():
    # batch-dim splits of the tricky ops, and linearity where it holds
    call, _ = op_call_of(aten.cumsum.default, (torch.randn(4, 6), 1), {})
    found = {(r.inputs, r.outputs) for r in discovery.discover(call)}
    assert ((Shard(0),), (Shard(0),)) in found
    assert ((Partial("sum"),), (Partial("sum"),)) in found  # cumsum is linear
    call, _ = op_call_of(aten.sort.default, (torch.randn(4, 6), 1), {})
    assert ((Shard(0),), (Shard(0), Shard(0))) in {(r.inputs, r.outputs) for r in discovery.discover(call)}


def test_random_ops_and_huge_ops_are_not_tried():
    call, _ = op_call_of(aten.rand_like.default, (torch.randn(4, 6),), {})
    assert discovery.discover(call) is None
    call, _ = op_call_of(aten.flip.default, (torch.randn(4, 6), [0]), {})
    huge = TensorMeta((4096, 4096), torch.float32)
    assert discovery.discover(replace(call, inputs=(huge,), outputs=(huge,))) is None
    call, _ = op_call_of(aten.add_.Tensor, (torch.randn(4, 6), torch.randn(4, 6)), {})
    assert discovery.discover(call) is None  # writes its input


def test_results_are_cached_per_signature():
    discovery.cache_clear()
    call, _ = op_call_of(aten.flip.default, (torch.randn(4, 6), [1]), {})
    first = discovery.discover(call)
    assert len(discovery._CACHE) == 1
    assert discovery.discover(call) == first and len(discovery._CACHE) == 1
    other, _ = op_call_of(aten.flip.default, (torch.randn(4, 8), [1]), {})
    discovery.discover(other)
    assert len(discovery._CACHE) == 2


def test_the_number_of_input_patterns_tried_is_capped():
    # six inputs of one size and two dims each: 3^6 sharding combinations, more than the cap
    call, _ = op_call_of(aten.stack.default, ([torch.randn(4, 4) for _ in range(6)],), {})
    patterns = discovery.input_patterns(call)
    assert len(patterns) <= discovery.MAX_INPUT_PATTERNS
    partial_alone = [tuple(Partial("sum") if j == i else Replicate() for j in range(6)) for i in range(6)]
    assert all(p in patterns for p in partial_alone)  # linearity is still tried
    # two sizes, each with more combinations than the cap
    call, _ = op_call_of(aten.cat.default, ([torch.randn(2, 2, 3, 3) for _ in range(4)],), {})
    assert len(discovery.input_patterns(call)) <= discovery.MAX_INPUT_PATTERNS


def test_ops_with_zero_element_outputs_are_discovered():
    # batch norm in eval mode returns empty saved statistics beside its output
    x, w, b, mean, var = torch.randn(8, 4), torch.randn(4), torch.randn(4), torch.randn(4), torch.rand(4) + 0.5
    call, _ = op_call_of(aten._native_batch_norm_legit_no_training.default, (x, w, b, mean, var, 0.1, 1e-5), {})
    assert call.outputs[1].shape == (0,)
    found = discovery.discover(call)
    assert found is not None
    batch_split = (Shard(0), Replicate(), Replicate(), Replicate(), Replicate())
    assert any(r.inputs == batch_split and r.outputs[0] == Shard(0) for r in found)
    assert not any(r.inputs[0] == Shard(1) and r.outputs[0] == Shard(1) and r.inputs[1] == Replicate()
                   for r in found)  # channels need their own statistics
