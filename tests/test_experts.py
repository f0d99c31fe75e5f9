"""Expert parallelism: transformers' mixture-of-experts routing becomes one routed_experts
op (passes/trace/experts.py), whose strategies (passes/rules/moe.py) run exactly in the
lockstep simulator; real gloo ranks are in test_equivalence.py (test_expert_parallel_matches)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import autopar
from autopar.core.placement import R, Shard
from autopar.core.routed import ROUTED_EXPERTS, body_of
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan.planning import plan_traced, trace_for_planning
from autopar.passes.rules import expand, rule_for
from autopar.passes.strategies.strategies import OpInput, op_call
from autopar.passes.trace.experts import collapse_routed_experts, routing_notes
from autopar.tools.simulated import CHEAP_COMM, reference_run, simulate_against
from tests import models

aten = torch.ops.aten
MOE = ("mixtral", "qwen3_moe", "deepseek_v3")


@functools.lru_cache(maxsize=None)  # one trace per family for the module (the tests only read it)
def _traced(family: str, batch: int = 4):
    m = models.build(family).train()
    args, kwargs = models.inputs(family, batch, 8)
    return m, args, kwargs, trace_for_planning(m, args, kwargs)


def _routed(traced) -> list:
    return [n for n in traced.gm.graph.nodes if n.target is ROUTED_EXPERTS]


@pytest.mark.slow  # three traces (the fast set keeps one: test_experts_split_on_one_axis_at_a_time)
@pytest.mark.parametrize("family", MOE)
def test_each_moe_layer_routes_through_one_op(family):
    m, _, _, traced = _traced(family)
    layers = sum(1 for name, _ in m.named_modules() if name.endswith("mlp.experts"))
    routed = _routed(traced)
    assert len(routed) == layers > 0
    left = {str(n.target) for n in traced.gm.graph.nodes} & {"aten.sort.default", "aten.histc.default",
                                                              "transformers.grouped_mm_fallback.default"}
    assert not left and routing_notes(traced.gm) == ()
    ids, rows, experts, row_group, num_experts, body = routed[0].args
    assert (row_group, num_experts) == ([2, 1], 8)  # the tokens (each row's token is row // top-k), the weights
    assert [tuple(w.meta["val"].shape)[0] for w in experts] == [8, 8]
    assert "grouped_mm" in body_of(body).code


def test_a_sort_that_is_not_routing_stays_and_says_why():
    class SortedGather(torch.nn.Module):  # the sorted ids are also added to the output: not only counted
        def forward(self, x, ids):
            s, perm = torch.sort(ids)
            counts = torch.cumsum(torch.histc(s.float(), bins=4, min=0, max=3), 0)
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.shape[0])
            return (x[perm] * 2)[inv] + s.unsqueeze(-1) + counts.sum()
    x, ids = torch.randn(6, 3), torch.tensor([3, 1, 2, 0, 1, 3])
    traced = trace_for_planning(SortedGather(), (x, ids))
    assert not _routed(traced)
    assert "the sorted ids are read by 2 ops" in " ".join(routing_notes(traced.gm))
    plan = autopar.plan(SortedGather(), (x, ids), mesh=(2,))
    assert "not expert-parallel: node sort" in plan.summary()


@pytest.mark.slow  # a second trace
def test_collapsing_twice_finds_nothing_more():
    traced = trace_for_planning(*_traced("mixtral")[:3])
    assert collapse_routed_experts(traced.gm) == 0


def test_experts_split_on_one_axis_at_a_time():
    _, _, _, traced = _traced("mixtral")
    call = op_call(_routed(traced)[0])
    strategies = expand(rule_for(ROUTED_EXPERTS)(call), call, (2, 2))
    # per axis: replicate, rows, experts (all-to-all), masked (partial); experts on both axes dropped
    assert len(strategies) == 16 - 4
    assert all(len(s.inputs[-1].shard_axes(0)) <= 1 for s in strategies)


def _check(family, mesh, plan, m, args, kwargs, traced):
    ref = reference_run(m, args, kwargs, training=True)
    assert simulate_against(m, args, kwargs, traced, plan, ref, context=f"{family} {mesh}") > 0


# DeepSeek-V3 here (a dense first layer, a shared expert); all three on gloo ranks in
# test_equivalence.py
@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_the_solver_sends_rows_to_their_experts_when_links_are_cheap(family):
    m, args, kwargs, traced = _traced(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(m, args, kwargs, mesh=(4,), device=CHEAP_COMM)
    routed = [n for n in plan.nodes if n.op == "autopar.routed_experts.default"]
    assert routed and all(str(n.inputs[0]) == "S(0)" and str(n.inputs[-1]) == "S(0)" for n in routed)
    _check(family, (4,), plan, m, args, kwargs, traced)


@pytest.mark.slow  # a simulated training step
def test_experts_split_with_rows_whole_sum_partial_outputs():
    m, args, kwargs, traced = _traced("qwen3_moe")
    node = _routed(traced)[0]
    experts = 1 + len(node.args[1])
    pins = {OpInput(node.name, 0): (R, R), OpInput(node.name, experts): (None, Shard(0))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_traced(traced, Mesh.of((2, 2)), Options(device=CHEAP_COMM, training=True), pins)[1]
    chosen = plan.node(node.name)
    assert str(chosen.inputs[0]) == "RR" and chosen.inputs[-1].placements[1] == Shard(0)
    assert chosen.outputs[0].placements[1].__class__.__name__ == "Partial"
    _check("qwen3_moe", (2, 2), plan, m, args, kwargs, traced)


def test_expert_parallelism_is_priced_by_rows_not_weights():
    # experts split where rows are split: each rank computes 1/n of the rows and pays four
    # all-to-alls of its rows (two forward, two backward); replicated, n times the compute
    from autopar.cost_models.model import CostModel
    from autopar.core.placement import Spec, TensorMeta
    costs = CostModel.analytic("h100", (8,), training=True)
    s, t, h, e, i = 65536, 8192, 2048, 64, 768  # matmul-bound: 16 GiB of routed rows, 1.1 GiB of experts
    def specs(ids_p, w_p):
        return ((Spec((ids_p,), TensorMeta((s,), torch.int64)), Spec((ids_p,), TensorMeta((t, h), torch.float32)),
                 Spec((ids_p,), TensorMeta((s,), torch.float32)), Spec((w_p,), TensorMeta((e, h, 2 * i), torch.float32)),
                 Spec((w_p,), TensorMeta((e, i, h), torch.float32))), (Spec((ids_p,), TensorMeta((s, h), torch.float32)),))
    whole = costs.op_cost(ROUTED_EXPERTS, *specs(R, R))
    ep = costs.op_cost(ROUTED_EXPERTS, *specs(Shard(0), Shard(0)))
    rows = costs.op_cost(ROUTED_EXPERTS, *specs(Shard(0), R))
    # as many rows as a rows-only split, and only its own experts' weights to read
    assert whole.comm_s == rows.comm_s == 0.0 and ep.compute_s <= rows.compute_s < whole.compute_s / 4
    from autopar.cost_models import comm
    link = costs.link(0)
    # per routed row: its token's h floats and its routing weight there, h floats back
    rows = s // 8
    there_and_back = [comm.all_to_all_s(b, 8, link) for b in (rows * h * 4, rows * 4, rows * h * 4)]
    want = 2 * sum(there_and_back) + comm.all_to_all_s(8 * e, 8, link)  # and the per-expert counts
    assert ep.comm_s == pytest.approx(want)
