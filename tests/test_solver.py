"""Golden plans with closed-form costs, offline (no processes)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import autopar
from autopar.core.kinds import NodeKind
from autopar.cost_models import comm, compute
from autopar.cost_models.devices import preset
from autopar.core.placement import TensorMeta
from autopar.passes.plan.hand_plans import DENSE_STYLES
from tests import models
from tests.models import MLP

aten = torch.ops.aten
CPU = preset("cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _plan(model, args, kwargs=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, kwargs, **kw)


def test_wide_mlp_batch1_is_megatron_with_closed_form_objective():
    # 4 layers 1024 -> 4096 -> 1024 -> 4096 -> 1024, batch 1, on (1, 4): column/row
    # alternation, so every linear runs on a quarter of its weight and each row layer's
    # partial sum is reduced once: the communication of L/2 = 2 all-reduces of a (1, 1024)
    # fp32 activation. The middle reduction is a reduce-scatter + all-gather pair (the
    # same ring cost as one all-reduce) because then the ReLU between them runs on a
    # quarter of the activation: that is the unique optimum, and its closed form is below.
    model = MLP((1024, 4096, 1024, 4096, 1024)).eval()
    plan = _plan(model, (torch.randn(1, 1024),), mesh=(1, 4))
    f32 = torch.float32
    x, w, b = TensorMeta((1, 1024), f32), TensorMeta((1024, 1024), f32), TensorMeta((1024,), f32)
    linear_s = compute.compute_s(CPU, aten.linear.default, (x, w, b), (x,))
    relu_s = compute.compute_s(CPU, aten.relu.default, (x,), (x,))
    q = TensorMeta((1, 256), f32)
    relu_quarter_s = compute.compute_s(CPU, aten.relu.default, (q,), (q,))
    all_reduce = comm.all_reduce_s(1024 * 4, 4, CPU.intra_link)
    assert all_reduce == pytest.approx(comm.reduce_scatter_s(4096, 4, CPU.intra_link)
                                       + comm.all_gather_s(4096, 4, CPU.intra_link))
    closed_form = 4 * linear_s + 2 * relu_s + relu_quarter_s + 2 * all_reduce
    assert plan.solver.status == "Optimal"
    assert plan.total_s == pytest.approx(closed_form, rel=1e-9)
    assert plan.solver.objective_s == pytest.approx(closed_form, rel=1e-6)
    # the bound the solver proves is a lower bound on the closed form, here a tight one
    assert closed_form * (1 - 1e-6) <= plan.solver.bound_s <= closed_form * (1 + 1e-9)
    assert "proven bound" in plan.summary() and "gap 0.00%" in plan.summary()
    assert plan.comm_s == pytest.approx(2 * all_reduce, rel=1e-9)
    weights = [n for n in plan.nodes if n.kind is NodeKind.PARAMETER and n.outputs[0].meta.ndim == 2]
    assert [str(n.outputs[0]) for n in weights] == ["RS(0)", "RS(1)", "RS(0)", "RS(1)"]
    assert [c.kind for c in plan.collectives()] == ["reduce_scatter", "all_gather", "all_reduce"]


def test_large_batch_is_pure_data_parallel():
    model = MLP((16, 64, 16)).eval()
    plan = _plan(model, (torch.randn(4096, 16),), mesh=(4, 1))
    assert all(n.outputs[0].is_replicated() for n in plan.nodes if n.kind is NodeKind.PARAMETER)
    assert plan.node("input_0").outputs[0].placements[0] == autopar.Shard(0)
    collectives = plan.collectives()
    assert [(c.kind, c.consumer) for c in collectives] == [("all_gather", "output")]


def test_same_inputs_give_the_same_plan():
    model = models.build("gpt2")
    args, kwargs = models.inputs("gpt2", batch=4)
    a = _plan(model, args, kwargs, mesh=(2, 2), device="h100")
    b = _plan(model, args, kwargs, mesh=(2, 2), device="h100")
    assert a.placements() == b.placements()
    assert a.total_s == b.total_s
    assert [str(c) for c in a.collectives()] == [str(c) for c in b.collectives()]


@pytest.mark.parametrize("name", ["mlp", "gpt2", pytest.param("llama", marks=pytest.mark.slow), "bert"])
def test_ilp_objective_equals_the_plans_recomputed_cost(name):
    # the ILP's modelled objective (groups, spec classes, followers) must price exactly
    # what the plan then runs
    model = models.build(name)
    args, kwargs = models.inputs(name, batch=4)
    plan = _plan(model, args, kwargs, mesh=(2, 2), device=_cheap_comm())
    assert plan.solver.status == "Optimal"
    assert plan.solver.objective_s == pytest.approx(plan.total_s, rel=1e-6)


def _cheap_comm():
    from tests.cases import CHEAP_COMM
    return CHEAP_COMM


def test_gpt2_batch1_block_communication_is_at_most_megatrons():
    hidden, seq = 256, 16
    model = models.build("gpt2", n_embd=hidden, n_head=8, vocab_size=512, n_positions=seq)
    ids = torch.randint(0, 512, (1, seq))
    plan = _plan(model, (), {"input_ids": ids}, mesh=(1, 4))
    megatron_block_s = 2 * comm.all_reduce_s(seq * hidden * 4, 4, CPU.intra_link)
    by_name = {n.name: n for n in plan.nodes}
    for layer in range(2):
        block = f"transformer.h.{layer}"
        block_comm = sum(e.comm_s for e in plan.edges
                         if by_name[e.consumer].module.startswith(block) and e.steps)
        assert block_comm <= megatron_block_s * (1 + 1e-9), (layer, block_comm, megatron_block_s)
    # the plan costs what the ILP priced, and its totals are the sums of its nodes and edges
    assert plan.solver.status == "Optimal"
    assert plan.solver.objective_s == pytest.approx(plan.total_s, rel=1e-6)
    assert plan.compute_s == pytest.approx(sum(n.compute_s for n in plan.nodes), rel=1e-12)
    assert plan.comm_s == pytest.approx(sum(e.comm_s for e in plan.edges), rel=1e-12)


def test_training_plan_counts_backward():
    model = MLP((16, 64, 16))
    x = torch.randn(64, 16)
    inference = _plan(model.eval(), (x,), mesh=(2, 2), training=False)
    training = _plan(model.train(), (x,), mesh=(2, 2))
    assert training.training and not inference.training
    assert training.total_s > inference.total_s


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "llama", "mlp"])  # fast set: 4 min
@pytest.mark.parametrize("mesh", [(1, 4), pytest.param((2, 2), marks=pytest.mark.slow)])
def test_solver_never_costs_more_than_hand_plans(name, mesh):
    from autopar.passes.plan.hand_plans import hand_plan
    model = models.build(name)
    args, kwargs = models.inputs(name, batch=4)
    device = _cheap_comm()
    auto = _plan(model, args, kwargs, mesh=mesh, device=device)
    # on (1, 4) the other context-parallel styles are cp or megatron again; (2, 2) has them all
    styles = DENSE_STYLES if mesh == (2, 2) else ("megatron", "data_parallel", "dp_tp", "fsdp", "cp")
    for style in styles:  # context-parallel styles pin attention, autopar leaves it free
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hand = hand_plan(model, args, kwargs, mesh=mesh, style=style, device=device)
        assert auto.total_s <= hand.total_s * (1 + 1e-9), (style, auto.total_s, hand.total_s)
    megatron = hand_plan(model, args, kwargs, mesh=mesh, style="megatron", device=device)
    assert any(not n.outputs[0].is_replicated() for n in megatron.nodes if n.kind is NodeKind.PARAMETER)


def test_solving_leaves_the_process_stdout_alone(capfd, monkeypatch):
    # silencing the solver must not redirect file descriptor 1 for the whole process:
    # whatever another thread writes while the ILP solves (here, the solve call itself)
    # still reaches stdout, and nothing else does (no solver banner)
    import autopar.passes.solve.solver_backend as backend
    run = backend._run_highs if backend.highspy is not None else backend._run_cbc
    calls = []

    def solve_and_write(*args, **kwargs):
        calls.append(1)
        os.write(1, b"written during the solve\n")
        return run(*args, **kwargs)

    monkeypatch.setattr(backend, run.__name__, solve_and_write)
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)  # on file descriptor 1, as outside pytest
    _plan(MLP((16, 64, 16)).eval(), (torch.randn(8, 16),), mesh=(2, 2))
    assert calls, "the solve did not go through the patched backend"
    assert capfd.readouterr().out == "written during the solve\n"


def test_a_fresh_process_plans_without_a_word_on_stdout():
    # HiGHS prints a banner from C the first time it logs in a process, before PuLP can
    # pass msg=False; planning spends it where nobody sees it
    code = ("import warnings, torch, autopar\n"
            "from tests.models import MLP\n"
            "warnings.simplefilter('ignore')\n"
            "autopar.plan(MLP((16, 64, 16)).eval(), (torch.randn(8, 16),), mesh=(2, 2))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("budget", [None, 2**40])
def test_dominance_pruning_keeps_the_objective_with_fewer_variables(monkeypatch, budget):
    # passes/solve/dominance.py claims pruning is exact: the ILP without it reaches the same
    # optimum (stated tolerance 1e-9 relative: only the order of float sums differs);
    # under a budget a choice must also need no more bytes to prune another
    import autopar.passes.solve.solve as solve_module
    model = models.build("gpt2")
    args, kwargs = models.inputs("gpt2", batch=2)
    kw = dict(mesh=(2, 2), device=_cheap_comm(), memory_budget_bytes=budget)
    pruned = _plan(model, args, kwargs, **kw)
    monkeypatch.setattr(solve_module, "prune_dominated", lambda model, pricer, with_memory: model)
    full = _plan(model, args, kwargs, **kw)
    assert pruned.solver.status == full.solver.status == "Optimal"
    assert pruned.solver.objective_s == pytest.approx(full.solver.objective_s, rel=1e-9)
    assert pruned.total_s == pytest.approx(pruned.solver.objective_s, rel=1e-9)
    assert pruned.solver.variables < full.solver.variables / 3, (pruned.solver.variables, full.solver.variables)


def test_edge_pricer_memos_price_exactly_as_the_cost_model():
    # EdgePricer memoises moves per layout pair and each step's seconds per local bytes;
    # every price must still equal CostModel.moves_cost of reshard_moves bit for bit
    from itertools import product
    from autopar.core.placement import P, R, Shard, Spec
    from autopar.core.resharding import reshard_moves
    from autopar.cost_models.edge_prices import INF, EdgePricer
    from autopar.cost_models.model import CostModel
    costs = CostModel.analytic("cpu", (2, 4), training=True)
    pricer = EdgePricer(costs)
    for meta in (TensorMeta((8, 16), torch.float32), TensorMeta((16, 8, 4), torch.bfloat16),
                 TensorMeta((8, 16), torch.int64)):
        layouts = list(product([R, P] + [Shard(d) for d in range(len(meta.shape))], repeat=2))
        for src, dst, axes in product(layouts, layouts, [(), (0,), (1,), (0, 1)]):
            a, b = Spec(src, meta), Spec(dst, meta)
            moves = reshard_moves(a, b, axes)
            want = INF if moves is None else costs.moves_cost(moves, meta).total_s
            assert pricer.cost_between(pricer.spec_id(a), (pricer.spec_id(b), axes)) == want, (src, dst, axes)


def test_price_tables_are_the_prices_and_shared_between_equal_edges():
    # two tensors of one meta (two layers' activations) price alike: one table for both
    from itertools import product
    from autopar.core.placement import P, R, Shard, Spec
    from autopar.cost_models.edge_prices import EdgePricer
    from autopar.cost_models.model import CostModel
    pricer = EdgePricer(CostModel.analytic("h100", (2, 4), training=True))
    layouts = list(product([R, P, Shard(0), Shard(1)], repeat=2))
    first, second = TensorMeta((8, 16), torch.float32), TensorMeta((8, 16), torch.float32)
    src = [pricer.spec_id(Spec(p, first)) for p in layouts]
    dst = [(pricer.spec_id(Spec(p, first)), axes) for p in layouts for axes in ((), (1,))]
    table = pricer.price_table(src, dst)
    assert table.dtype == torch.float64 and tuple(table.shape) == (len(src), len(dst))
    assert table.tolist() == [[pricer.price_between(o, r) for r in dst] for o in src]
    again = [pricer.spec_id(Spec(p, second)) for p in layouts]  # value-equal specs: the same numbers
    assert again == src and pricer.price_table(again, tuple(dst)) is table
    assert pricer.price_table(src[:3], dst) is not table and pricer.price_table(src[:3], dst).shape[0] == 3


def test_dominance_pruning_counts_every_copy_of_a_clustered_edge(monkeypatch):
    # under layer clustering an edge has twins, one per repeated block, each adding its
    # price to the objective: pruning that counted a twin once kept a choice whose own
    # saving it overrated, and the h100 plan of an 8-layer Llama on (1, 8) cost 12 % more
    # than data parallelism (19.1 vs 17.0 ms, bench/plan_quality.py)
    import autopar.passes.solve.solve as solve_module
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced, trace_for_planning
    from autopar.tools.zoo import build
    model, args, kwargs = build("llama-small", batch=8, seq=512, training=True, device="meta")
    traced = trace_for_planning(model, args, kwargs)
    options = Options(device="h100", training=True)
    pruned = plan_traced(traced, Mesh((1, 8)), options)[1]
    assert pruned.solver.shared_blocks > 0, "the test needs clustered (twin) edges"
    monkeypatch.setattr(solve_module, "prune_dominated", lambda model, pricer, with_memory: model)
    full = plan_traced(traced, Mesh((1, 8)), options)[1]
    assert pruned.solver.objective_s == pytest.approx(full.solver.objective_s, rel=1e-9)


def test_cbc_fallback_reaches_the_highs_optimum():
    # the program passes/solve/solver_backend.py hands HiGHS as arrays goes to CBC through PuLP
    # when highspy is missing: both must read it alike (bounds, equality rows, the
    # budget row, fixed columns) and so reach the same optimum
    model, args = MLP((16, 64, 16)).train(), (torch.randn(8, 16),)
    for budget in (None, 2**40):
        highs = _plan(model, args, mesh=(2, 2), solver="highs", memory_budget_bytes=budget)
        cbc = _plan(model, args, mesh=(2, 2), solver="cbc", memory_budget_bytes=budget)
        assert (highs.solver.solver, cbc.solver.solver) == ("highs", "cbc")
        assert cbc.solver.status == highs.solver.status == "Optimal"
        assert cbc.solver.objective_s == pytest.approx(highs.solver.objective_s, rel=1e-9)
        assert cbc.total_s == pytest.approx(highs.total_s, rel=1e-9)


# both in the slow set (8-9 s each); CBC is the fallback, and its bound is its proven optimum
@pytest.mark.slow
@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_no_plan_of_the_search_space_costs_less_than_the_proven_bound(solver):
    """Every hand plan (a point of the same search space, priced by the same cost model)
    costs at least the bound; the bound is at most the objective."""
    model, args, kwargs = models.build("gpt2"), *models.inputs("gpt2", batch=4)
    plan = _plan(model, args, kwargs, mesh=(2, 2), device="h100", solver=solver)
    bound = plan.solver.bound_s
    assert bound is not None and bound <= plan.solver.objective_s * (1 + 1e-9), plan.solver
    for style in DENSE_STYLES:
        hand = autopar.hand_plan(model, args, kwargs, mesh=(2, 2), style=style, device="h100")
        assert autopar.evaluate(hand, device="h100").total_s >= bound * (1 - 1e-9), style


def test_context_parallel_pins_follow_what_the_inputs_take():
    # one sequence (batch 1) on (2, 4) with dp_cp: the batch split is dropped from the
    # inputs and the attention alike, the sequence split kept; tp_cp with 2 key/value
    # heads over 4 ranks leaves the head axis to the solver; dp_cp on (4, 1) has nothing
    # to split by sequence
    from autopar.core.errors import HandPlanError
    from autopar.core.placement import R, Shard
    from autopar.passes.plan.hand_plans import hand_pins
    from autopar.passes.plan.planning import trace_for_planning
    from autopar.passes.strategies.strategies import OpOutput
    model = models.build("causal")
    args, kwargs = models.inputs("causal", batch=1, seq=8)
    traced = trace_for_planning(model, args, kwargs)
    pins = hand_pins(model, traced, (2, 4), "dp_cp")
    attention = [v for k, v in pins.items() if isinstance(k, OpOutput)]
    assert attention == [(R, Shard(2))] * 2 and pins[0] == pins[1] == (R, Shard(1))
    pins = hand_pins(model, traced, (2, 4), "tp_cp")
    assert [v for k, v in pins.items() if isinstance(k, OpOutput)] == [(Shard(2), None)] * 2
    hand = autopar.hand_plan(model, args, kwargs, mesh=(2, 4), style="tp_cp", device="h100")
    assert {str(n.outputs[0])[:4] for n in hand.nodes if n.op == "aten.scaled_dot_product_attention.default"} == {"S(2)"}
    with pytest.raises(HandPlanError, match=r"'dp_cp' splits the sequence over mesh axes \(1,\), of size 1"):
        hand_pins(model, traced, (4, 1), "dp_cp")


def test_only_inputs_as_long_as_the_sequence_are_split_by_it():
    # a 4-D mask [B, 1, L, L] and a [B, 16] feature input keep dim 1 whole under cp
    from autopar.core.placement import R, Shard
    from autopar.passes.plan.hand_plans import input_pins
    from autopar.passes.trace.trace import trace

    class WithMask(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.lin = torch.nn.Embedding(16, 8), torch.nn.Linear(16, 8)

        def forward(self, ids, mask, features):
            return self.embed(ids) * mask[:, 0, :, :1] + self.lin(features)[:, None, :]

    ids, mask, feats = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 1, 8, 8), torch.randn(2, 16)
    pins = input_pins(trace(WithMask(), (ids, mask, feats)), (4,), (), (0,), "cp")
    assert pins == {0: (Shard(1),), 1: (R,), 2: (R,)}


def test_dominance_reads_exact_differences_where_the_cheap_bound_leaves_a_chance():
    """The pairwise worst differences equal the full table's entries, and the cheap
    bound (the worst difference over probe columns) never exceeds them nor falls below
    the difference of the rows' least prices."""
    from autopar.cost_models.edge_prices import INF
    from autopar.passes.solve.dominance import PROBE_COLUMNS, _pair_worst_difference, _probed_difference
    g = torch.Generator().manual_seed(0)
    width = PROBE_COLUMNS + 5  # more columns than probes, so the bound is not the exact table
    b = torch.rand(23, width, generator=g, dtype=torch.float64)
    b[b > 0.8] = INF  # columns a choice cannot meet
    b[3] = INF  # a choice that meets none
    # [j, i]: the max over the columns r that i can meet of b[j, r] - b[i, r]
    full = torch.where((b < INF)[None, :, :], b[:, None, :] - b[None, :, :], -INF).max(-1).values
    j, i = torch.meshgrid(torch.arange(23), torch.arange(23), indexing="ij")
    assert torch.equal(_pair_worst_difference(b, j.flatten(), i.flatten()), full.flatten())
    bound = _probed_difference(b)
    finite = torch.isfinite(full)
    assert bool((bound[finite] <= full[finite]).all())
    assert bool((bound[full == -INF] == -INF).all())
    lowest = b.min(1).values
    least = lowest[:, None] - lowest[None, :]
    met = torch.isfinite(least)
    assert bool((bound[met] >= least[met]).all())
    assert bool((bound < full)[finite].any()), "the probes were every column: the bound was never cheap"


def test_the_solver_stops_at_options_mip_gap_and_a_frontier_point_at_its_own(monkeypatch):
    # Options.mip_gap reaches HiGHS; the pipeline's frontier points (pipeline_units.lean_frontier)
    # are solved to FRONTIER_GAP, each stage's own plan afterwards to Options.mip_gap
    from autopar.passes.solve import solver_backend
    from autopar.passes.plan import pipeline_units
    from tests.models import build, inputs
    seen = []
    run = solver_backend._run_highs
    monkeypatch.setattr(solver_backend, "_run_highs", lambda p, limit, start=None, gap=1e-4: seen.append(gap) or run(
        p, limit, start, gap))
    warnings.simplefilter("ignore")
    model, kw = build("gpt2", n_layer=2).train(), inputs("gpt2", batch=4)[1]
    plan = autopar.plan(model, (), kw, mesh=(2,), mip_gap=0.02, solver="highs")
    assert seen and set(seen) == {0.02} and plan.solver.status == "Optimal"
    seen.clear()
    free = autopar.plan(model, (), kw, mesh=(2, 1), pipeline_axis=0, microbatches=2, solver="highs")
    piped = autopar.plan(model, (), kw, mesh=(2, 1), pipeline_axis=0, microbatches=2, solver="highs",
                         memory_budget_bytes=free.memory_bytes - 1)
    assert pipeline_units.FRONTIER_GAP in seen and 1e-4 in seen, seen
    assert piped.memory_bytes < free.memory_bytes
