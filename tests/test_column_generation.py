"""Column generation over the flows (passes/solve/column_generation.py): forced on small
three-axis plans, it reaches the optimum the whole ILP reaches, and what it reports
(status, bound) is true of the whole ILP. Offline, no processes."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

import autopar
import autopar.passes.solve.column_generation as column_generation
from autopar.core.options import Options
from autopar.passes.solve.ilp_terms import LinearTerms, link_classes
from autopar.passes.solve.solver_backend import LinearProgram, SolveStatus, solve_program
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


def _random_program(seed: int, groups: int = 5, choices: int = 6):
    """One-hot groups on a ring plus chords (cycles make the LP relaxation fractional),
    an edge's flows over every pair of choices, random costs; and the whole start of
    every group's first choice."""
    rng = random.Random(seed)
    prob = LinearProgram()
    s = [[prob.column(binary=True) for _ in range(choices)] for _ in range(groups)]
    for g in s:
        prob.row({v: 1.0 for v in g}, 1.0, 1.0)
    terms, flows = LinearTerms(), []
    pairs = [(g, (g + 1) % groups) for g in range(groups)] + [(g, (g + 2) % groups) for g in range(0, groups, 2)]
    for u, v in pairs:
        matrix = [[rng.choice([0.0, rng.uniform(1, 50)]) * 1e-6 for _ in range(choices)] for _ in range(choices)]
        edge, _, _ = link_classes(prob, [[x] for x in s[u]], [[x] for x in s[v]], matrix, flows=flows)
        terms.extend(edge)
    for g in s:
        for v in g:
            terms.add(v, rng.uniform(0, 20))
    prob.minimise(terms.coef, terms.constant)
    values = np.zeros(len(prob.cost))
    first = {g[0] for g in s}
    values[list(first)] = 1.0
    for x, src, dst in flows:
        values[x] = float(src[0] in first and dst[0] in first)
    return prob, (np.arange(len(values), dtype=np.int32), values)


# 24, 65, 124, 137 and 143: the master's own optimum is not the whole program's; the close step finds it
@pytest.mark.parametrize("seed", [*range(8), 24, 65, 124, 137, 143])
def test_column_generation_keeps_the_whole_programs_optimum_and_a_true_bound(seed, monkeypatch):
    program, start = _random_program(seed)
    options = Options(time_limit_s=60.0)
    whole = solve_program(program, options)
    generated = column_generation.solve_by_columns(program, options, start)
    assert whole.status is generated.status is SolveStatus.OPTIMAL
    assert generated.objective == pytest.approx(whole.objective, rel=1e-6)
    assert generated.bound <= whole.objective * (1 + 1e-9)
    flows = sum(program.priced)
    assert 0 < flows and sum(program.priced[j] and v > 0.5 for j, v in enumerate(generated.values)) <= flows
    # the close step's columns capped: the master's plan, Feasible, with the LP's bound
    monkeypatch.setattr(column_generation, "CLOSE_AT_MOST", 0)
    capped = column_generation.solve_by_columns(program, options, start)
    assert capped.bound <= whole.objective * (1 + 1e-9) and capped.objective >= whole.objective * (1 - 1e-9)
    within = capped.objective - capped.bound <= options.mip_gap * capped.objective + 1e-9
    assert (capped.status is SolveStatus.OPTIMAL) == within, (capped.status, capped.objective, capped.bound)
