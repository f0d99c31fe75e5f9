"""The solver's first plan on a mesh of three axes: its merged mesh's plan, carried over
(passes/solve/warm_start.py). Offline, no processes."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
import autopar.passes.solve.solve as solve_module
from autopar.core.mesh import Mesh
from autopar.core.placement import Replicate, Shard, Spec, TensorMeta
from autopar.passes.solve.solver_backend import Solution, SolveStatus
from autopar.passes.solve.warm_start import merged_axes, merges, refined
from tests.models import MLP

R = Replicate()


def _plan(model, args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, **kw)


@pytest.mark.parametrize("shape,merged,axis", [
    ((2, 2, 2), (2, 4), 1), ((2, 3, 4), (2, 12), 1), ((2, 1, 2, 2), (2, 1, 4), 2), ((2, 2, 1, 2), (4, 1, 2), 0),
    ((2, 2, 2, 2), (2, 2, 4), 2)])
def test_the_innermost_adjacent_pair_of_real_axes_is_merged(shape, merged, axis):
    assert merged_axes(Mesh(shape)) == (Mesh(merged), axis)


def test_every_adjacent_pair_of_real_axes_can_be_merged_outermost_first():
    assert merges(Mesh((2, 4, 8))) == ((Mesh((8, 8)), 0), (Mesh((2, 32)), 1))
    assert merges(Mesh((2, 1, 2, 2))) == ((Mesh((2, 1, 4)), 2),)
    assert merges(Mesh((2, 2, 2, 2))) == ((Mesh((4, 2, 2)), 0), (Mesh((2, 4, 2)), 1), (Mesh((2, 2, 4)), 2))
    assert merges(Mesh((2, 4))) == ()


@pytest.mark.parametrize("shape", [(8,), (2, 4), (2, 1, 4), (1, 2, 1, 2)])
def test_a_mesh_of_two_real_axes_or_fewer_starts_from_nothing(shape):
    assert merged_axes(Mesh(shape)) is None


def test_a_placement_on_the_merged_axis_is_the_same_placement_on_both_of_its_parts():
    model, x = MLP().train(), torch.randn(64, 16)
    coarse = _plan(model, (x,), mesh=(2, 4), device="cpu")
    start = refined(coarse, 1)
    assert start.source == (2, 4)
    for n in coarse.nodes:
        ins, outs = start.layouts[n.name]
        for spec, fine in zip(n.inputs + n.outputs, ins + outs):
            p, q = spec.placements
            assert fine == (p, q, q)
    # a shard over the 4-way axis is the block a shard over the two 2-way axes gives:
    # rank r keeps the same rows of a (64, 16) tensor on (2, 4) and on (2, 2, 2)
    meta = TensorMeta((64, 16), torch.float32)
    wide, narrow = Spec((R, Shard(0)), meta), Spec((R, Shard(0), Shard(0)), meta)
    for r in range(8):
        assert wide.local_shape_at((2, 4), Mesh((2, 4)).coords(r)) == narrow.local_shape_at(
            (2, 2, 2), Mesh((2, 2, 2)).coords(r))


def test_a_three_axis_plan_starts_from_its_merged_mesh_plan_and_is_no_worse():
    model, x = MLP().train(), torch.randn(64, 16)
    coarse = _plan(model, (x,), mesh=(2, 4), device="cpu")
    fine = _plan(model, (x,), mesh=(2, 2, 2), device="cpu")
    assert fine.solver.start.startswith("the (2, 4) plan's layouts, for ")
    set_groups, groups = (int(w) for w in fine.solver.start.split("for ")[1].split(" groups")[0].split(" of "))
    assert set_groups == groups == fine.solver.groups
    # every (2, 4) plan is a (2, 2, 2) plan; the finer mesh prices a collective over its two
    # axes as two, so its optimum may cost more, but never more than the plan it started from
    assert fine.solver.status == "Optimal"
    assert fine.total_s <= _stopped_at_the_start(model, x).total_s * (1 + 1e-9)
    assert "started from the (2, 4) plan's layouts" in fine.summary()


def _stopped_at_the_start(model, x):
    """The (2, 2, 2) plan when the solver stops before it has any plan of its own."""
    original = solve_module.solve_ilp

    def stopped(program, options, start=(), **how):
        if not start:  # the (2, 4) plan solves as usual
            return original(program, options, start, **how)
        return Solution(SolveStatus.NOT_SOLVED, (0.0,) * len(program.cost), 0.0, None, 0.1)

    solve_module.solve_ilp = stopped
    try:
        return _plan(model, (x,), mesh=(2, 2, 2), device="cpu")
    finally:
        solve_module.solve_ilp = original


def test_a_solver_stopped_with_nothing_returns_the_plan_it_started_from():
    model, x = MLP().train(), torch.randn(64, 16)
    coarse = _plan(model, (x,), mesh=(2, 4), device="cpu")
    start = refined(coarse, 1)
    plan = _stopped_at_the_start(model, x)
    assert plan.solver.status == "Not Solved (time limit 120.0 s): the plan started from"
    assert plan.solver.bound_s is None and plan.solver.objective_s == plan.total_s
    for n in plan.nodes:
        assert (tuple(s.placements for s in n.inputs), tuple(s.placements for s in n.outputs)) == start.layouts[n.name]


def _never_solved(monkeypatch):
    """Every solve stops at its time limit before it has a plan of its own."""
    monkeypatch.setattr(solve_module, "solve_ilp", lambda program, options, start=(), **how: Solution(
        SolveStatus.NOT_SOLVED, (0.0,) * len(program.cost), 0.0, None, 0.1))


def test_a_solver_stopped_with_nothing_and_no_start_returns_a_greedy_plan_that_runs(monkeypatch):
    """Greedy (passes/solve/greedy.py): each op's group the cheapest against the choices
    before it, the parameters stored as their readers want them. The plan is a real one:
    the simulated ranks train it to the single-device outputs and gradients."""
    from autopar.passes.plan.planning import trace_for_planning
    from autopar.tools.simulated import reference_run, simulate_against
    model, x = MLP().train(), torch.randn(64, 16)
    best = _plan(model, (x,), mesh=(2, 4), device="cpu")
    _never_solved(monkeypatch)
    plan = _plan(model, (x,), mesh=(2, 4), device="cpu")
    assert plan.solver.status.startswith("Not Solved (time limit 120.0 s): a greedy plan, not the solver's")
    assert plan.total_s >= best.total_s * (1 - 1e-9) and plan.solver.objective_s == plan.total_s
    traced = trace_for_planning(model, (x,))
    assert simulate_against(model, (x,), {}, traced, plan, reference_run(model, (x,), {}, training=True)) > 0
    # a three-axis mesh starts from its merged mesh's greedy plan, which sets every group
    fine = _plan(model, (x,), mesh=(2, 2, 2), device="cpu")
    assert fine.solver.status.endswith(": the plan started from")


def test_a_stopped_solver_whose_greedy_plan_is_over_the_budget_is_an_error(monkeypatch):
    model, x = MLP().train(), torch.randn(64, 16)
    _never_solved(monkeypatch)
    greedy = _plan(model, (x,), mesh=(2, 4), device="cpu", memory_budget_bytes=10**9)
    assert greedy.solver.status.endswith("a greedy plan, not the solver's (passes/solve/greedy.py)")
    with pytest.raises(autopar.SolverError, match="over the budget of .* MiB; raise Options.time_limit_s"):
        _plan(model, (x,), mesh=(2, 4), device="cpu", memory_budget_bytes=greedy.memory_bytes - 1)


def test_a_whole_start_is_a_solution_of_the_program_priced_as_the_plan_it_is(monkeypatch):
    """Where the start sets every group, every column is handed over (flows at 1 where both
    their classes are picked): the solver has nothing to complete, so it must satisfy
    every row and bound as it is, and its objective must be the started plan's price."""
    model, x = MLP().train(), torch.randn(64, 16)
    seen = {}
    original = solve_module.solve_ilp

    def keeping(program, options, start=None, **how):
        if start is not None:
            seen["program"], seen["start"] = program, start
        return original(program, options, start, **how)

    monkeypatch.setattr(solve_module, "solve_ilp", keeping)
    _plan(model, (x,), mesh=(2, 2, 2), device="cpu")
    monkeypatch.setattr(solve_module, "solve_ilp", original)
    program, (columns, values) = seen["program"], seen["start"]
    assert list(columns) == list(range(len(program.cost)))
    assert all(lo <= v <= up for lo, v, up in zip(program.lower, values, program.upper))
    for r in range(program.num_rows):
        span = range(program.row_start[r], program.row_start[r + 1])
        row = sum(program.row_value[k] * values[program.row_index[k]] for k in span)
        assert program.row_lower[r] - 1e-9 <= row <= program.row_upper[r] + 1e-9, r
    objective_s = (sum(c * v for c, v in zip(program.cost, values)) + program.constant) / 1e6
    assert objective_s == pytest.approx(_stopped_at_the_start(model, x).total_s, rel=1e-9)
