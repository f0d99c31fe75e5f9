"""Activation recompute decided by the ILP (passes/solve/recompute_ilp.py) and run under
torch.utils.checkpoint (passes/lower/recompute.py): no budget, no recompute; a budget between
"every activation kept" and "every block recomputed" recomputes some blocks at the
closed-form price (compute + the recomputed blocks' forward); the smallest footprint
counts recompute; plans round-trip through JSON; gradients match one device in the
simulator and on gloo ranks; the saved bytes measured drop."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from autopar.core.errors import MemoryBudgetError, PlanFileError
from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.plan import Plan
from autopar.cost_models.evaluate import evaluate, op_target, recompute_terms
from autopar.cost_models.model import CostModel
from autopar.passes.solve import solve as solve_module
from autopar.passes.lower.emit import emit
from autopar.passes.plan.planning import plan_traced
from autopar.passes.lower.recompute import Recomputed
from autopar.passes.solve.recompute_ilp import block_terms
from autopar.passes.trace.saved import saved_outputs
from autopar.passes.trace.trace import trace
from autopar.tools.memory_meter import kept_per_rank
from autopar.tools.simulated import simulate_against
from tests.models import build, inputs

TRAIN = Options(training=True)


def _plan(traced, mesh: tuple, **over) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_traced(traced, Mesh(mesh), replace(TRAIN, **over))[1]


def _smallest(traced, mesh: tuple) -> int:
    with pytest.raises(MemoryBudgetError) as e:
        _plan(traced, mesh, memory_budget_bytes=1)
    return e.value.smallest_bytes


@pytest.fixture(scope="module")
def llama4():
    """Llama, 4 layers, on one device: only recompute can save memory."""
    torch.set_num_threads(1)
    model = build("llama", num_hidden_layers=4).train()
    args, kwargs = inputs("llama", batch=4, seq=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, args, kwargs)
    free = _plan(traced, (1,))
    return model, args, kwargs, traced, free, _smallest(traced, (1,))


def test_no_budget_no_recompute(llama4):
    *_, traced, free, _ = llama4
    assert free.recompute == ()
    assert _plan(traced, (1,), memory_budget_bytes=10 * free.memory_bytes).recompute == ()


def test_smallest_footprint_recomputes_every_block(llama4):
    *_, traced, free, smallest = llama4
    tight = _plan(traced, (1,), memory_budget_bytes=smallest)
    assert [b.name for b in tight.recompute] == [f"model.layers.{i}" for i in range(4)]
    dropped = -recompute_terms(free.nodes, free.edges, tight.recompute, CostModel.analytic("cpu", (1,), True)).memory_bytes
    assert dropped > 0 and smallest == free.memory_bytes - dropped == tight.memory_bytes


def test_budget_between_recomputes_some_blocks_at_closed_form_cost(llama4):
    *_, traced, free, smallest = llama4
    budget = (free.memory_bytes + smallest) // 2
    plan = _plan(traced, (1,), memory_budget_bytes=budget)
    assert 0 < len(plan.recompute) < 4 and plan.memory_bytes <= budget < free.memory_bytes
    forward = CostModel.analytic("cpu", (1,), training=False)
    again = sum(forward.op_cost(op_target(n.op), n.inputs, n.outputs).compute_s
                for b in plan.recompute for n in map(plan.node, b.nodes) if n.kind.computes)
    assert free.comm_s == plan.comm_s == 0
    assert plan.solver.objective_s == pytest.approx(free.compute_s + again, rel=1e-9)
    assert plan.total_s == pytest.approx(plan.solver.objective_s, rel=1e-9)
    ev = evaluate(plan)
    assert ev.total_s == pytest.approx(plan.total_s, rel=1e-12) and ev.memory_bytes == plan.memory_bytes
    # fewer blocks recomputed would not fit: each block drops the same bytes here
    per_block = (free.memory_bytes - smallest) // 4
    assert free.memory_bytes - (len(plan.recompute) - 1) * per_block > budget


def test_plan_json_round_trip(llama4, tmp_path):
    *_, traced, free, smallest = llama4
    plan = _plan(traced, (1,), memory_budget_bytes=smallest)
    plan.to_json(tmp_path / "plan.json")
    back = Plan.from_json(tmp_path / "plan.json")
    assert back.recompute == plan.recompute and back.digest() == plan.digest()
    assert replace(plan, recompute=()).digest() != plan.digest()
    stored = plan.to_dict()
    stored["recompute"][0]["nodes"].append("no_such_node")  # a hand-edited file
    with pytest.raises(PlanFileError, match="no_such_node"):
        Plan.from_dict(stored)


def test_saved_bytes_drop_as_measured(llama4):
    """Bytes the forward leaves for backward (autopar/tools/memory_meter.py), one device:
    recompute drops them as the plan predicts, within 20 %, and the plan's saved bytes
    without recompute are within 20 % of the measure (passes/trace/saved.py decides which
    outputs count). The recomputing plan alone is not asserted: checkpoint also keeps
    region inputs no op saves (the attention mask) and an RNG state per region, which
    the plan does not count (bench/recompute_memory.py prints all three ratios)."""
    model, args, kwargs, traced, free, smallest = llama4
    tight = _plan(traced, (1,), memory_budget_bytes=smallest)
    kept_free, kept_tight = kept_per_rank(model, args, kwargs, traced, free), kept_per_rank(model, args, kwargs, traced, tight)
    assert kept_tight < 0.3 * kept_free
    drop = (kept_free - kept_tight) / (free.activation_bytes - tight.activation_bytes)
    assert 0.8 <= drop <= 1.2, (drop, kept_free, kept_tight, free.activation_bytes, tight.activation_bytes)
    assert 0.8 <= kept_free / free.activation_bytes <= 1.2, (kept_free, free.activation_bytes)


def test_saved_outputs_are_found_under_a_callers_inference_mode():
    """Planning from inside torch.inference_mode: the fake run still records what autograd
    saves (seeing nothing saved would count no activation bytes at all)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced, again = (trace(model, (torch.randn(4, 8),), {}) for _ in range(2))
    with torch.inference_mode():
        under = saved_outputs(traced)
    assert under == saved_outputs(again) == {"linear": (True,), "gelu": (True,), "linear_1": (False,)}


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_saved_outputs_by_signature_equal_the_run_in_order(name, param_dtype):
    """Each distinct op call run once (saved._by_signature) finds what the graph run op by op
    finds, output for output, in fp32 and bf16 training graphs (views of parameters and
    inputs, routed experts, multi-output ops), and is what saved_outputs answers."""
    from autopar.passes.trace import saved
    model = build(name).train()
    args, kwargs = inputs(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, args, kwargs, param_dtype=param_dtype)
    in_order = saved._run_in_order(traced)
    assert any(any(kept) for kept in in_order.values()) and not all(all(kept) for kept in in_order.values())
    assert saved._by_signature(traced) == in_order == saved_outputs(traced)


def test_saved_outputs_fall_back_to_the_run_in_order(monkeypatch):
    """A call that cannot run alone sends the graph to the op-by-op run, with the same answer."""
    from autopar.passes.trace import saved
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, (torch.randn(4, 8),), {})

    def unmodelled(node, leaves, grad):
        raise saved._Unmodelled(node.name)

    monkeypatch.setattr(saved, "_run_alone", unmodelled)
    assert saved._run(traced) == {"linear": (True,), "gelu": (True,), "linear_1": (False,)}


@pytest.fixture(scope="module")
def two_way():
    """Llama and GPT-2 (2 layers) on 2 simulated ranks under budgets that recompute."""
    out = {}
    for name in ("llama", "gpt2"):
        model = build(name).train()
        args, kwargs = inputs(name, batch=4, seq=16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = trace(model, args, kwargs)
        out[name] = model, args, kwargs, traced, _plan(traced, (2,))
    return out


def test_recompute_or_shard_the_cheaper_wins(two_way, monkeypatch):
    *_, traced, free = two_way["llama"]
    budget = int(free.memory_bytes * 0.8)
    plan = _plan(traced, (2,), memory_budget_bytes=budget)
    monkeypatch.setattr(solve_module, "block_terms", lambda *a, **k: ())  # the ILP without recompute
    shard_only = _plan(traced, (2,), memory_budget_bytes=budget)
    assert shard_only.recompute == () and plan.recompute
    assert plan.total_s < shard_only.total_s and plan.memory_bytes <= budget


def test_dominance_pruning_keeps_the_recompute_optimum(two_way, monkeypatch):
    """passes/solve/dominance.py prunes choices inside recomputable blocks only where the
    forward seconds, kept bytes and forward edge prices are no worse too: exact."""
    *_, traced, free = two_way["gpt2"]
    budget = int(free.memory_bytes * 0.6)
    pruned = _plan(traced, (2,), memory_budget_bytes=budget)
    monkeypatch.setattr(solve_module, "prune_dominated", lambda model, *a, **k: model)
    full = _plan(traced, (2,), memory_budget_bytes=budget)
    assert pruned.recompute and pruned.solver.status == full.solver.status == "Optimal"
    assert pruned.solver.objective_s == pytest.approx(full.solver.objective_s, rel=1e-9)
    assert pruned.solver.variables < full.solver.variables


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_gradients_match_one_device_in_simulation(two_way, name):
    model, args, kwargs, traced, free = two_way[name]
    plan = _plan(traced, (2,), memory_budget_bytes=_smallest(traced, (2,)))
    assert plan.recompute
    program = emit(traced, plan, (0,))
    assert sum(isinstance(m, Recomputed) for m in program.gm.modules()) == len(plan.recompute)
    assert simulate_against(model, args, kwargs, traced, plan, context=name) > 0


def recompute_on_ranks(rank: int, world: int, plan_path: str, steps: int = 2) -> dict:
    """A gloo rank runs a plan file that recomputes: per step its loss and gradients
    next to one device's (the same weights each step, so a gradient synced twice, or a
    collective rerun out of order, shows)."""
    import copy
    import autopar
    from tests.cases import _grad_pairs, _loss
    model = build("llama").train()
    reference = copy.deepcopy(model)
    args, kwargs = inputs("llama", batch=4, seq=16)
    ref_loss = _loss(reference(*args, **kwargs))
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters(remove_duplicate=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, args, kwargs, mesh=(world,), plan=plan_path)
    out = {"recomputed": sum(isinstance(m, Recomputed) for m in pm.current.program.gm.modules()), "steps": []}
    for _ in range(steps):
        pm.zero_grad(set_to_none=True)
        loss = _loss(pm(*args, **kwargs))
        loss.backward()
        out["steps"].append({"loss": loss.detach(), "grads": _grad_pairs(pm, ref_grads, rank)})
    out["ref_loss"] = ref_loss.detach()
    return out


class _Block(torch.nn.Module):
    def __init__(self, d: int = 32, h: int = 128) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ResStack(torch.nn.Module):
    """Residual MLP blocks: a large batch makes it data parallel, and its activations
    (the ReLU outputs, inside each block) are what a budget must drop."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _stack_inputs(seed: int) -> torch.Tensor:
    return torch.randn(2048, 32, generator=torch.Generator().manual_seed(seed))


def data_parallel_recompute(rank: int, world: int, plan_path: str) -> dict:
    """Data-parallel blocks recomputed: two backwards accumulate; each parameter's
    bucketed gradient all-reduce (deferred out of the program) must fire once per step."""
    import copy
    import autopar
    from autopar.core.placement import local_chunk
    model = ResStack().train()
    reference = copy.deepcopy(model)
    xs = [_stack_inputs(s) for s in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, (xs[0],), mesh=(world,), plan=plan_path)
    for x in xs:
        (pm(x) ** 2).mean().backward()
        (reference(x) ** 2).mean().backward()
    grads = {k: (pm.shards.get_parameter(k).grad, local_chunk(p.grad, pm.state_specs[k], pm.mesh.shape, pm.coords))
             for k, p in reference.named_parameters()}
    return {"deferred": pm.current.program.deferred_grad_syncs, "grads": grads,
            "recomputed": sum(isinstance(m, Recomputed) for m in pm.current.program.gm.modules())}


@pytest.mark.slow
def test_gradients_match_one_device_on_gloo_ranks(two_way, tmp_path):
    """One spawn: Llama with every block recomputed (sharded parameters gathered again in
    backward) and a data-parallel residual stack with some blocks recomputed."""
    *_, traced, free = two_way["llama"]
    plan = _plan(traced, (2,), memory_budget_bytes=_smallest(traced, (2,)))
    assert plan.recompute
    plan.to_json(tmp_path / "llama.json")
    stack = _stack_plan()
    stack.to_json(tmp_path / "stack.json")
    from tests.harness import run_ranks
    results = run_ranks(2, [(recompute_on_ranks, dict(plan_path=str(tmp_path / "llama.json"))),
                            (data_parallel_recompute, dict(plan_path=str(tmp_path / "stack.json")))])
    for res, dp in results:
        assert "error" not in res and "error" not in dp, (res.get("error"), dp.get("error"))
        assert res["recomputed"] == len(plan.recompute)
        for step in res["steps"]:
            torch.testing.assert_close(step["loss"], res["ref_loss"], rtol=1e-5, atol=1e-6)
            for name, (local, expect, spec) in step["grads"].items():
                if expect is None:
                    assert local is None or not local.any(), name
                else:
                    torch.testing.assert_close(local, expect, msg=lambda m: f"{name} ({spec}): {m}")
        assert dp["recomputed"] == len(stack.recompute) and len(dp["deferred"]) == 12
        for name, (local, expect) in dp["grads"].items():
            torch.testing.assert_close(local, expect, msg=lambda m: f"{name}: {m}")


def _stack_plan() -> Plan:
    """ResStack on 2 ranks, data parallel, under a budget that recomputes 1 or 2 of its 3 blocks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(ResStack().train(), (_stack_inputs(1),))
    free = _plan(traced, (2,))
    plan = _plan(traced, (2,), memory_budget_bytes=(free.memory_bytes + _smallest(traced, (2,))) // 2)
    assert 0 < len(plan.recompute) < 3 and all(n.outputs[0].is_replicated() for n in plan.nodes
                                                 if n.kind is NodeKind.PARAMETER)
    return plan


def test_only_blocks_priced_alike_are_ordered_as_twins(monkeypatch):
    """r[b] >= r[b'] (symmetry) only between blocks with the same terms: the first
    clustered block reads its input from the unclustered block 0, so its rerun is priced
    on other variables than its copies' and it is no twin of theirs (it was, which could
    force it to recompute before a cheaper copy)."""
    got = []

    def spy(*args, **kwargs):
        got.append((args[0], block_terms(*args, **kwargs)))
        return got[-1][1]

    monkeypatch.setattr(solve_module, "block_terms", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(ResStack(5), (_stack_inputs(0),), {})
    with pytest.raises(MemoryBudgetError):
        _plan(traced, (2,), memory_budget_bytes=1)
    model, blocks = got[0]
    assert {b.name: b.twin for b in blocks} == {f"blocks.{i}": f"blocks.{min(i, 2) if i < 4 else 4}" for i in range(5)}
    by_name = {b.name: b for b in blocks}
    for b in blocks:
        twin = by_name[b.twin]
        keys = [[model.edges[k].twin_key(model.rep) for k in c.edges] for c in (b, twin)]
        assert keys[0] == keys[1], (b.name, twin.name)
