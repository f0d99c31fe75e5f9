"""Column generation over the flows (passes/solve/column_generation.py): forced on small
three-axis plans, it reaches the optimum the whole ILP reaches, and what it reports
(status, bound) is true of the whole ILP. Offline, no processes."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
import autopar.passes.solve.column_generation as column_generation
from tests.models import MLP, CausalLM


def _plan(model, args, kwargs=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, kwargs or {}, **kw)


def _cases():
    torch.manual_seed(0)
    yield pytest.param(("mlp", MLP().train(), (torch.randn(64, 16),), {}), id="mlp")
    ids = torch.randint(0, 64, (4, 16))  # a causal LM: about 50 s, twice the MLP's flows per edge
    yield pytest.param(("causal_lm", CausalLM(layers=1).train(), (ids,), {"labels": ids}), id="causal_lm",
                       marks=pytest.mark.slow)


@pytest.mark.parametrize("case", list(_cases()))
def test_generated_columns_reach_the_whole_ilps_optimum(case, monkeypatch):
    _, model, args, kwargs = case
    whole = _plan(model, args, kwargs, mesh=(2, 2, 2), device="h100")
    calls = []
    original = column_generation.solve_by_columns

    def counted(program, options, start):
        solution = original(program, options, start)
        calls.append((sum(program.priced), sum(v != 0 for v in solution.values)))
        return solution
    monkeypatch.setattr(column_generation, "PRICED_FROM", 1)
    monkeypatch.setattr(column_generation, "solve_by_columns", counted)
    generated = _plan(model, args, kwargs, mesh=(2, 2, 2), device="h100")
    assert calls, "the three-axis solve, which starts from a whole plan, went through column generation"
    assert whole.solver.status == generated.solver.status == "Optimal"
    assert generated.total_s == pytest.approx(whole.total_s, rel=2e-4)  # both within mip_gap 1e-4 of the optimum
    assert generated.solver.bound_s <= whole.total_s * (1 + 1e-9)  # a true bound of the whole ILP
    assert generated.solver.objective_s == pytest.approx(generated.total_s, rel=1e-9)


def test_a_program_below_the_threshold_or_without_a_whole_start_is_solved_whole(monkeypatch):
    monkeypatch.setattr(column_generation, "solve_by_columns", lambda *a: pytest.fail("solved by columns"))
    model, x = MLP().train(), torch.randn(64, 16)
    assert _plan(model, (x,), mesh=(2, 2, 2), device="h100").solver.status == "Optimal"  # few flows
    monkeypatch.setattr(column_generation, "PRICED_FROM", 1)
    assert _plan(model, (x,), mesh=(2, 4), device="h100").solver.status == "Optimal"  # no start on two axes
