"""The runtime's parts: one error type on every rank, the eager plan, process groups
made once per mesh, and rank programs that run only once bound to process groups."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.core.errors import FingerprintMismatchError, MemoryBudgetError, ProcessGroupError
from autopar.passes.emit import emit
from autopar.passes.planning import plan_traced
from autopar.passes.trace import trace
from tests import models
from tests.harness import run_ranks


# ---- cases run on every gloo rank (module level: the spawned ranks import them) ----------

def rank0_planning_error(rank: int, world: int) -> dict:
    """Only rank 0 solves; its MemoryBudgetError must reach every rank as itself."""
    m = models.build("mlp")
    x = torch.randn(8, 16)
    try:
        autopar.compile(m, (x,), mesh=(world,), memory_budget_bytes=1)
    except autopar.AutoparError as e:
        return {"type": type(e).__name__, "budget": getattr(e, "budget_bytes", None),
                "notes": list(getattr(e, "__notes__", []))}
    return {"type": None}


def eager_plan_and_group_reuse(rank: int, world: int) -> dict:
    m = models.build("mlp")
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = autopar.compile(m, (x,), mesh=(world,))
        digest_before_any_call = first.plan.digest()  # planned now: no call needed
        code = first.code
        second = autopar.compile(models.build("mlp", seed=3), (x,), mesh=(world,))
        with torch.no_grad():
            out = first(x)
    return {"digest": digest_before_any_call, "has_code": "def forward" in code,
            "same_groups": all(a.group is b.group for a, b in zip(first.comms, second.comms)),
            "out": out, "want": m(x).detach()}


def verify_gpt2(rank: int, world: int) -> dict:
    """verify on a transformers model whose config keeps its KV cache on: the reference
    runs as traced (no cache), so outputs pair up one to one."""
    m = models.build("gpt2")
    m.config.use_cache = True
    args, kwargs = models.inputs("gpt2")
    report = autopar.verify(m, args, kwargs, mesh=(world,))
    return {"ok": report.ok, "outputs": len(report.outputs), "text": str(report), "use_cache": m.config.use_cache}


# ---- tests ---------------------------------------------------------------------------

def test_an_error_while_rank0_plans_is_raised_as_itself_on_every_rank():
    results = run_ranks(2, [(rank0_planning_error, {})])
    for rank, (res,) in enumerate(results):
        assert res["type"] == "MemoryBudgetError", (rank, res)
        assert res["budget"] == 1
    assert any("raised on rank 0" in n for n in results[1][0]["notes"])


def test_eager_compile_has_its_plan_at_once_and_groups_are_made_once_per_mesh():
    results = run_ranks(2, [(eager_plan_and_group_reuse, {})])
    digests = {res["digest"] for (res,) in results}
    assert len(digests) == 1
    for (res,) in results:
        assert res["has_code"] and res["same_groups"]
        torch.testing.assert_close(res["out"], res["want"])


def test_a_plan_for_another_graph_is_one_error_type():
    x = torch.randn(8, 16)
    plan = plan_traced(trace(models.build("mlp"), (x,)), autopar.Mesh((2,)), autopar.Options())[1]
    other = trace(models.build("mlp"), (torch.randn(4, 16),))  # other shapes: another graph
    with pytest.raises(FingerprintMismatchError) as err:
        emit(other, plan, (0,))
    assert err.value.expected == plan.fingerprint and err.value.found == other.fingerprint
    assert "re-plan" in str(err.value)


def test_an_unbound_program_says_it_cannot_run():
    x = torch.randn(8, 16)
    traced = trace(models.build("mlp"), (x,))
    plan = plan_traced(traced, autopar.Mesh((2,)), autopar.Options(device="h100"),
                       pinned={"layers.0.weight": (autopar.Shard(0),)})[1]
    program = emit(traced, plan, (0,))
    assert "ap_" in program.code  # it has reshard steps
    state = dict(models.build("mlp").named_parameters())
    with pytest.raises(ProcessGroupError, match="emitted for reading"):
        from autopar.passes.emit import local_inputs
        program.gm(*local_inputs(program, {k: v.detach() for k, v in state.items()}, traced.constants, [x], (2,),
                                 state_is_local=False))


def test_memory_budget_error_pickles_with_its_fields():
    import pickle
    e = pickle.loads(pickle.dumps(MemoryBudgetError(10, 20)))
    assert (e.budget_bytes, e.smallest_bytes) == (10, 20) and "smallest footprint" in str(e)


def test_verify_a_transformers_model_with_its_kv_cache_on():
    results = run_ranks(2, [(verify_gpt2, {})])
    for (res,) in results:
        assert res["ok"], res["text"]
        assert res["outputs"] == 2  # loss and logits, no cache tensors
        assert res["use_cache"] is True  # the user's config is as it was
