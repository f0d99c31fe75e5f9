"""The overlapped step (cost_models/overlap.py): gradient buckets hide under the backward
that follows their launch, and the solver, the plan and evaluate() price it alike."""

from __future__ import annotations

import warnings
from operator import getitem

import pytest
import torch

import autopar
from autopar.cost_models import comm
from autopar.cost_models.devices import DeviceSpec, Link
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.model import CostModel
from autopar.cost_models import overlap
from autopar.cost_models.hiding import credit_s
from autopar.cost_models.overlap import (BUCKET_BYTES, MAX_WINDOW, Bucket, ParamUse, Window, activation_windows,
                                         edge_share_table, edge_shares, grad_buckets, left_by_parameters, stretches)
from tests import models
from tests.models import MLP

MIB = 2**20


# ---- the stretch arithmetic ---------------------------------------------------------

@pytest.mark.parametrize("hideable, share, hidden", [
    (1.0, 3.0, 1.0),  # hides fully: the stretch costs max(compute, comm) = compute
    (3.0, 1.0, 1.0),  # comm-bound: the stretch costs max(...) = comm, i.e. compute + 2 exposed
    (2.0, 0.0, 0.0),  # launched after the last backward op: nothing to hide under, the sum
])
def test_a_bucket_costs_the_larger_of_its_stretch_and_itself(hideable, share, hidden):
    assert credit_s(hideable, share) == hidden
    assert share + hideable - credit_s(hideable, share) == max(share, hideable)


def test_a_stretch_is_shared_by_bytes_and_a_parameters_part_by_its_uses():
    # positions 0..5; w (3 MiB, used at 2 and 4) and b (1 MiB, used at 3) share a bucket
    # launched after position 2's backward: its stretch is positions [0, 2)
    params = [("w", 3 * MIB), ("b", 1 * MIB)]
    uses = [ParamUse("w", 2, "e1"), ParamUse("w", 4, "e2"), ParamUse("b", 3, "e3")]
    shares = edge_shares(params, uses, [1.0, 3.0, 100.0, 100.0, 100.0, 100.0])
    assert shares == {"e1": 1.5, "e2": 1.5, "e3": 1.0}


def test_buckets_fill_in_backward_order_and_launch_at_their_earliest_use():
    # reverse program order; w1 does not fit beside w2; b0 shares w1's bucket and, used
    # earlier, makes it launch later in backward (at position 1, not 3)
    params = [("w0", 16 * MIB), ("b0", 4), ("w1", 16 * MIB), ("w2", 10 * MIB)]
    use = {"w0": 1, "b0": 1, "w1": 3, "w2": 5}
    buckets = grad_buckets(params, use)
    assert buckets == (Bucket(("w2",), 5), Bucket(("w1", "b0"), 1), Bucket(("w0",), 1))
    assert stretches(buckets) == ((1, 5), (1, 1), (0, 1))
    assert grad_buckets(params, use, bucket_bytes=BUCKET_BYTES * 4) == (Bucket(("w2", "w1", "b0", "w0"), 1),)


# ---- plans --------------------------------------------------------------------------

# a 16 MiB all-reduce (6.3 ms) outlasts a layer's backward at 16384 rows (2.7 ms), yet
# data parallelism beats running every layer replicated (4x the compute)
SLOW_LINK = DeviceSpec("slow-link", {torch.float32: 1e14}, mem_bw_bytes_per_s=1e12, op_overhead_s=0.0,
                       intra_link=Link(1e-5, 2.5e-10), inter_link=Link(1e-5, 2.5e-10), achievable=1.0)


class SummedMLP(MLP):
    """A scalar out: no output gather to outweigh the gradient all-reduces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).sum()


def _dp_mlp_plan(batch: int, device: "str | DeviceSpec" = "cpu", grad_sync_every: int = 1):
    # three 2048 x 2048 fp32 weights (16 MiB each, no bias): buckets [w2], [w1], [w0]
    with torch.device("meta"):
        model = SummedMLP((2048, 2048, 2048, 2048), bias=False).train()
        x = torch.randn(batch, 2048)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, (x,), mesh=(4,), training=True, device=device, grad_sync_every=grad_sync_every)


def test_data_parallel_buckets_hide_under_backward_except_the_first_layers():
    # a big batch: data parallel, and each layer's backward outlasts a 16 MiB all-reduce.
    # w2's and w1's buckets hide under the backward of the layers before them; w0's
    # gradient is the last one backward makes, so its all-reduce is all exposed
    plan = _dp_mlp_plan(8192)
    assert all(str(n.outputs[0]) == "R" for n in plan.nodes if n.kind.is_state), plan.placements()
    one = comm.all_reduce_s(16 * MIB, 4, plan.links[0].link)
    assert plan.hidden_s == pytest.approx(2 * one, rel=1e-9)
    assert plan.total_s == pytest.approx(plan.compute_s + plan.comm_s - 2 * one, rel=1e-12)


def test_solver_plan_and_evaluate_price_the_overlapped_step_alike():
    plan = _dp_mlp_plan(8192)
    ev = evaluate(plan)
    assert plan.hidden_s > 0
    assert ev.hidden_s == pytest.approx(plan.hidden_s, rel=1e-12)
    assert ev.total_s == pytest.approx(plan.total_s, rel=1e-12)
    assert ev.exposed_comm_s == pytest.approx(plan.comm_s - plan.hidden_s, rel=1e-12)
    assert plan.solver.objective_s == pytest.approx(plan.total_s, rel=1e-6)


def test_a_comm_bound_step_hides_only_the_backward_after_the_first_launch():
    # each all-reduce outlasts the backward it runs under, so what hides is the backward
    # compute after w2's launch (the two earlier layers' backward), all of it; the batch
    # is big enough that gathering it to skip data parallelism would cost more
    plan = _dp_mlp_plan(65536, device=SLOW_LINK)
    assert all(str(n.outputs[0]) == "R" for n in plan.nodes if n.kind.is_state), plan.placements()
    ev = evaluate(plan, cost_model=CostModel.analytic(SLOW_LINK, (4,), training=True))
    assert ev.total_s == pytest.approx(plan.total_s, rel=1e-12)
    names = [n.name for n in plan.nodes]
    after = plan.nodes[:names.index("linear_2")]
    assert [n.op for n in after if n.compute_s > 0] == ["aten.linear.default", "aten.relu.default"] * 2
    # a step's compute is forward + backward: linear's backward is 2x its forward, relu's 1x
    backward = sum(n.compute_s * (2 / 3 if "linear" in n.op else 1 / 2) for n in after)
    assert ev.hidden_s == pytest.approx(backward, rel=1e-9)
    assert ev.total_s == pytest.approx(ev.compute_s + ev.comm_s - backward, rel=1e-12)


def test_a_reduction_once_per_four_backwards_prices_each_a_quarter_of_it():
    # Options.grad_sync_every=4, a pipeline stage with 4 microbatches: each backward pays a
    # quarter of each bucket's all-reduce, and that quarter is what may hide; the plan,
    # its file and evaluate() agree
    each = _dp_mlp_plan(65536, device=SLOW_LINK)
    quarter = _dp_mlp_plan(65536, device=SLOW_LINK, grad_sync_every=4)
    assert all(str(n.outputs[0]) == "R" for n in quarter.nodes if n.kind.is_state), quarter.placements()
    one = comm.all_reduce_s(16 * MIB, 4, quarter.links[0].link)
    synced = [e for e in quarter.edges if e.steps and all(s.kind.value == "grad_sync" for s in e.steps)]
    assert len(synced) == 3 and all(e.comm_s == pytest.approx(one / 4, rel=1e-9) for e in synced)
    assert quarter.comm_s == pytest.approx(each.comm_s - 3 * one * 3 / 4, rel=1e-9)
    assert quarter.hidden_s <= 2 * one / 4 + 1e-12 and quarter.total_s < each.total_s
    assert quarter.grad_sync_every == 4 and "once per 4 backwards" in quarter.summary()
    again = autopar.Plan.from_dict(quarter.to_dict())
    assert again.grad_sync_every == 4
    ev = evaluate(again, cost_model=CostModel.analytic(SLOW_LINK, (4,), training=True))
    assert (ev.comm_s, ev.hidden_s, ev.total_s) == pytest.approx((quarter.comm_s, quarter.hidden_s, quarter.total_s),
                                                                 rel=1e-12)
    assert quarter.solver.objective_s == pytest.approx(quarter.total_s, rel=1e-6)


def test_inference_hides_nothing():
    with torch.device("meta"):
        model = MLP((2048, 2048, 2048), bias=False).eval()
        x = torch.randn(8192, 2048)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (x,), mesh=(4,), device="cpu")
    assert plan.hidden_s == 0.0 and evaluate(plan).hidden_s == 0.0
    assert plan.total_s == plan.compute_s + plan.comm_s


def test_pruning_stays_exact_with_the_overlap_family(monkeypatch):
    # dominance compares serial prices; a choice that hides more could lose to one that
    # only looks cheaper serially, so pruning charges what a choice could hide less
    import autopar.passes.solve.solve as solve_module
    pruned = _dp_mlp_plan(65536, device=SLOW_LINK)
    monkeypatch.setattr(solve_module, "prune_dominated", lambda model, pricer, with_memory: model)
    full = _dp_mlp_plan(65536, device=SLOW_LINK)
    assert full.hidden_s > 0
    assert pruned.solver.objective_s == pytest.approx(full.solver.objective_s, rel=1e-9)


def test_a_pipelined_plan_splits_its_step_as_its_stages_plans_do():
    # each stage's step is its plan's total_s (compute and the communication its program
    # does not hide), what the stage's solve minimised, so the pipelined step counts what
    # a stage hides; the step splits into compute, comm and hidden as the stages' sums do
    from tests.models import build, inputs
    # 1024 wide: each block's 48 MiB of parameters fills its own gradient bucket, so some hide
    model = build("gpt2", n_layer=4, n_embd=1024, n_head=16, n_positions=256).train()
    kw = inputs("gpt2", batch=16, seq=256)[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis=0, microbatches=2)
    stages = plan.stage_plans
    assert any(sp.hidden_s > 0 for sp in stages)
    assert [s.step_s for s in plan.pipeline.stages] == [sp.total_s for sp in stages]
    serial = sum(sp.total_s for sp in stages)
    for part in ("compute_s", "comm_s", "hidden_s"):
        want = sum(getattr(sp, part) for sp in stages) / serial
        assert getattr(plan, part) / plan.total_s == pytest.approx(want, rel=1e-9), part
    assert plan.total_s == pytest.approx(plan.pipeline.step_s, rel=1e-12)


# ---- prefetched parameter gathers (GPU presets) -------------------------------------------

def _fsdp_mlp_plan(device: str):
    with torch.device("meta"):
        model = MLP((2048, 2048, 2048, 2048), bias=False).train()
        x = torch.randn(8192, 2048)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.hand_plan(model, (x,), mesh=(4,), style="fsdp", device=device)


def test_a_prefetched_gather_hides_under_the_compute_since_the_previous_use():
    # FSDP: each 16 MiB weight is gathered before its linear. The gather of w1 (w2) is
    # issued after linear (linear_1) and waited before linear_1 (linear_2): it hides under
    # the relu between them, forward and backward (its gradient's reduce-scatter); w0's
    # gather has nothing before it. Each window hides min(comm, compute) per direction.
    plan = _fsdp_mlp_plan("h100")
    link = plan.links[0].link
    gather, scatter = comm.all_gather_s(16 * MIB, 4, link), comm.reduce_scatter_s(16 * MIB, 4, link)
    relus = [n for n in plan.nodes if n.op == "aten.relu.default"]
    assert len(relus) == 2
    # a relu's step compute is forward + backward, one pass each; the window counts the least
    least = [min(a.compute_s for a in n.options) / 2 for n in relus]
    want = sum(min(gather, f) + min(scatter, f) for f in least)
    assert 0 < want < 2 * (gather + scatter)
    assert plan.hidden_s == pytest.approx(want, rel=1e-9)
    ev = evaluate(plan)
    assert ev.hidden_s == pytest.approx(plan.hidden_s, rel=1e-12) and ev.total_s == pytest.approx(plan.total_s)


def test_inference_on_a_gpu_preset_hides_the_prefetched_gathers_forward():
    # no backward, no buckets: each gather hides under the relu before its linear, forward only
    with torch.device("meta"):
        model = MLP((2048, 2048, 2048, 2048), bias=False).eval()
        x = torch.randn(8192, 2048)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.hand_plan(model, (x,), mesh=(4,), style="fsdp", device="h100")
    gather = comm.all_gather_s(16 * MIB, 4, plan.links[0].link)
    relus = [n for n in plan.nodes if n.op == "aten.relu.default"]
    assert plan.hidden_s == pytest.approx(sum(min(gather, min(a.compute_s for a in n.options)) for n in relus),
                                          rel=1e-9)
    assert plan.hidden_s > 0 and evaluate(plan).hidden_s == pytest.approx(plan.hidden_s, rel=1e-12)
    assert plan.solver.objective_s == pytest.approx(plan.total_s, rel=1e-6)


def test_the_cpu_preset_credits_no_prefetch():
    # gloo on shared cores: a collective competes with compute for the same cores
    assert _fsdp_mlp_plan("cpu").hidden_s == 0.0


@pytest.mark.slow  # a trace, a pinned solve and an emitted program of a 2-layer Llama
def test_the_schedule_prefetches_each_gather_by_the_previous_use():
    # FSDP with the sequence split (fsdp_cp) on (4,): keys and values are gathered between
    # the parameter uses, yet every parameter's first collective is issued no later than
    # right after the previous parameter use (passes/lower/schedule.py, 2.), not behind them
    from autopar.passes.lower.emit import emit
    from autopar.passes.lower.program import StepModule, WaitModule
    from autopar.passes.trace.trace import trace
    from tests import models
    m = models.build("llama").train()
    args, kwargs = models.inputs("llama", batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.hand_plan(m, args, kwargs, mesh=(4,), style="fsdp_cp", device="h100")
    gm = emit(trace(m, args, kwargs), plan, (1,)).gm
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    module = {n: gm.get_submodule(n.target) for n in nodes if n.op == "call_module"}
    waits = {n for n, mod in module.items() if isinstance(mod, WaitModule)}
    prefetched = [n for n, mod in module.items() if isinstance(mod, StepModule) and any(u in waits for u in n.users)
                  and all(a.op == "placeholder" for a in n.all_input_nodes)]

    def first_use(start):
        todo, best = [next(u for u in start.users if u in waits)], len(nodes)
        while todo:
            for u in todo.pop().users:
                if u.op == "call_function":
                    best = min(best, index[u])
                elif u.op == "call_module":
                    todo.append(u)
        return best

    uses = sorted({first_use(s) for s in prefetched})
    assert len(uses) > 10
    for s in prefetched:  # no compute between the previous use and the start: it was issued right after
        at = uses.index(first_use(s))
        lo = uses[at - 1] if at else 0
        compute = [n.name for n in nodes[lo + 1:index[s]] if n.op == "call_function" and n.target is not getitem]
        assert not compute, (s.name, compute)


# ---- activation windows (GPU presets) -----------------------------------------------

def test_an_activation_window_is_the_positions_between_its_ends():
    position = {"a": 0, "b": 1, "c": 2, "d": 5, "far": 60}
    edges = [("a", "b", 0, 8), ("a", "d", 1, 8), ("c", "d", 0, 4), ("p", "d", 2, 8), ("a", "far", 0, 8)]
    windows = activation_windows(position, edges)
    # a -> b are neighbours (nothing between), p is no op, a -> far is longer than MAX_WINDOW
    assert windows == [Window(("d", 1), 1, 5, 8), Window(("d", 0), 3, 5, 4)]
    assert MAX_WINDOW < 59


def test_activations_get_what_the_parameters_cannot_use_split_by_bytes():
    least = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    # w is used at 0 (an empty window before it), v at 3: v's window is positions 1, 2 (6 s)
    # and v's first step takes at most 1.5 s, so a quarter of each is the parameters' and
    # three quarters are left; position 0 (a use) and those past the last use are all left
    params, uses = [("w", 4), ("v", 4)], [ParamUse("w", 0, "ew"), ParamUse("v", 3, "ev")]
    left = left_by_parameters(uses, least, {"w": 9.0, "v": 1.5})
    assert left == [1.0, 1.5, 3.0, 8.0, 16.0, 32.0]
    # x (2 bytes) covers 1..3, y (6 bytes) 2..5: a position both cover is split 2:6
    windows = [Window("x", 1, 4, 2), Window("y", 2, 6, 6)]
    table = edge_share_table(params, uses, least, least, activations=windows,
                             bound_s={"w": (9.0, 9.0), "v": (1.5, 1.5)})
    assert table["x"].window_forward_s == pytest.approx(1.5 + 3.0 * 2 / 8 + 8.0 * 2 / 8)
    assert table["y"].window_backward_s == pytest.approx(3.0 * 6 / 8 + 8.0 * 6 / 8 + 16.0 + 32.0)
    # the parameters' shares are what they are without activation windows
    assert table["ev"] == edge_share_table(params, uses, least, least)["ev"]
    # never credited twice: v's credit is at most 1.5 of its window, the windows get the rest
    assert 1.5 + table["x"].window_forward_s + table["y"].window_forward_s == pytest.approx(sum(least[1:]))


def _fsdp_cp_plan(device: str):
    m = models.build("llama").train()
    args, kwargs = models.inputs("llama", batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.hand_plan(m, args, kwargs, mesh=(4,), style="fsdp_cp", device=device)


def test_keys_and_values_gathered_beside_compute_are_credited_and_priced_alike(monkeypatch):
    # fsdp_cp: keys and values are gathered along the sequence before attention, and the
    # gather of the keys runs beside the values' compute. On a GPU preset the plan,
    # evaluate() and the solver's objective credit it alike; without activation windows
    # the same plan hides less; on the CPU preset nothing hides
    plan = _fsdp_cp_plan("h100")
    ev = evaluate(plan)
    assert ev.hidden_s == pytest.approx(plan.hidden_s, rel=1e-12) and ev.total_s == pytest.approx(plan.total_s)
    assert plan.solver.objective_s == pytest.approx(plan.total_s, rel=1e-6)
    monkeypatch.setattr(overlap, "MAX_WINDOW", 0)
    assert evaluate(plan).hidden_s < plan.hidden_s
    assert _fsdp_cp_plan("cpu").hidden_s == 0.0
