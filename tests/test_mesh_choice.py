"""mesh="auto" (passes/plan/mesh_choice.py): the planner tries every 1-, 2- and 3-axis mesh
of the devices and keeps the cheapest, listing what it tried."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.core.kinds import NodeKind
from autopar.core.links import Link
from autopar.core.plan import Plan
from autopar.passes.plan.mesh_choice import factorisations, mesh_candidates
from tests import models
from tests.models import MLP


def test_the_candidates_are_the_factorisations_one_per_axis_order_on_one_node():
    assert factorisations(8) == ((8,), (2, 4), (4, 2), (2, 2, 2))
    assert [m.shape for m in mesh_candidates(8)] == [(8,), (2, 4), (2, 2, 2)]
    assert [m.shape for m in mesh_candidates(8, nodes=2)] == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    assert [m.shape for m in mesh_candidates(1)] == [(1,)]
    assert len(mesh_candidates(64)) == 1 + 3 + 3  # (64,); (2,32) (4,16) (8,8); (2,2,16) (2,4,8) (4,4,4)
    with pytest.raises(autopar.MeshError, match="nodes=3 does not divide"):
        mesh_candidates(8, nodes=3)


def _chosen(model, args, kwargs=None, **options) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, kwargs, mesh="auto", devices=4, **options)


def test_a_big_batch_on_the_cpu_preset_chooses_data_parallelism_the_cheapest_listed():
    plan = _chosen(MLP().train(), (torch.randn(4096, 16),), device="cpu")
    tried = {c.shape: c for c in plan.mesh_candidates}
    assert set(tried) == {(4,), (2, 2)}
    assert plan.total_s == pytest.approx(min(c.step_s for c in tried.values()))
    assert tried[plan.mesh.shape].step_s == pytest.approx(plan.total_s)
    inputs = [n for n in plan.nodes if n.kind is NodeKind.USER_INPUT]
    params = [n for n in plan.nodes if n.kind is NodeKind.PARAMETER]
    assert all("S(0)" in str(n.outputs[0]) for n in inputs)  # the batch split
    assert all(n.outputs[0].is_replicated() for n in params)  # the weights whole: data parallelism
    assert "mesh: " in plan.summary() and f"* {plan.mesh.shape}" in plan.explain_mesh()
    assert Plan.from_dict(plan.to_dict()).mesh_candidates == plan.mesh_candidates


def test_a_candidate_the_time_limit_stopped_is_listed_as_not_proven(tmp_path):
    """A candidate whose solve a time limit cut short says so, with the bound the solver
    proved, in explain_mesh, the summary and the plan file. (Which solve a real limit
    stops depends on the machine's speed, so the stopped solve's report is made here.)"""
    from dataclasses import replace

    from autopar.core.plan_parts import MeshCandidate
    from autopar.passes.plan.mesh_choice import _unproven_bound
    plan = _chosen(MLP().train(), (torch.randn(64, 16),), device="cpu")
    assert plan.solver.status == "Optimal" and _unproven_bound(plan) is None
    assert all(c.bound_s is None for c in plan.mesh_candidates)
    stopped = replace(plan, solver=replace(plan.solver, status="Feasible (time limit 0.1 s)", bound_s=plan.total_s / 2))
    assert _unproven_bound(stopped) == pytest.approx(plan.total_s / 2)
    assert _unproven_bound(replace(stopped, solver=replace(stopped.solver, bound_s=None))) == 0.0
    other = next(c for c in plan.mesh_candidates if c.shape != plan.mesh.shape)
    cut = MeshCandidate(other.shape, other.step_s, other.memory_bytes, bound_s=_unproven_bound(stopped))
    listed = replace(plan, mesh_candidates=tuple(cut if c.shape == other.shape else c for c in plan.mesh_candidates))
    text = listed.explain_mesh()
    assert f"no plan of it is under {plan.total_s / 2 * 1e3:.3f} ms" in text and text.count("not proven") == 1
    assert "1 of them not solved to a proven optimum" in listed.summary()
    path = tmp_path / "plan.json"
    listed.to_json(path)
    assert Plan.from_json(path).mesh_candidates == listed.mesh_candidates


def test_a_three_axis_candidate_starts_from_the_cheapest_plan_of_its_merged_meshes(monkeypatch):
    """Over 2 nodes both (4, 2) and (2, 4) are planned before (2, 2, 2), and each is one of
    its plans (its outer or its inner pair merged): the solve starts from the cheaper one."""
    from autopar.passes.plan import mesh_choice
    handed: dict[tuple[int, ...], object] = {}
    made: dict[tuple[int, ...], Plan] = {}
    plan_graph = mesh_choice.plan_graph

    def spied(traced, mesh, options, coarse=None):
        handed[mesh.shape] = coarse
        made[mesh.shape] = plan_graph(traced, mesh, options, coarse=coarse)
        return made[mesh.shape]
    monkeypatch.setattr(mesh_choice, "plan_graph", spied)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.plan(MLP().train(), (torch.randn(4096, 16),), mesh="auto", devices=8, nodes=2, device="cpu",
                     links={"inter": Link(1e-3, 1e-8, "slow")})  # a slow link between nodes: the orders differ
    assert [s for s, c in handed.items() if c is not None] == [(2, 2, 2)]
    assert made[(2, 4)].total_s != made[(4, 2)].total_s
    cheaper = min(made[(2, 4)], made[(4, 2)], key=lambda p: p.total_s)
    assert handed[(2, 2, 2)] is cheaper
    assert made[(2, 2, 2)].solver.start.startswith(f"the {cheaper.mesh.shape} plan's layouts")


@pytest.mark.slow  # six budgeted solves of GPT-2
def test_a_tight_budget_chooses_a_model_parallel_mesh():
    # GPT-2 on the CPU preset keeps every weight whole; at half its footprint the weights
    # are split (stored sharded or tensor parallel) on the cheapest mesh that fits
    model = models.build("gpt2").train()
    args, kwargs = models.inputs("gpt2", batch=4)
    free = _chosen(model, args, kwargs, device="cpu")
    assert all(n.outputs[0].is_replicated() for n in free.nodes if n.kind is NodeKind.PARAMETER)
    budget = int(free.memory_bytes * 0.5)
    plan = _chosen(model, args, kwargs, device="cpu", memory_budget_bytes=budget)
    assert plan.memory_bytes <= budget
    assert any(not n.outputs[0].is_replicated() for n in plan.nodes if n.kind is NodeKind.PARAMETER)
    fitting = [c for c in plan.mesh_candidates if c.step_s is not None]
    assert plan.total_s == pytest.approx(min(c.step_s for c in fitting))
    with pytest.raises(autopar.SolverError, match=r"no mesh of 4 devices has a plan .*\n  \(4,\): MemoryBudgetError"):
        _chosen(model, args, kwargs, device="cpu", memory_budget_bytes=1024)


def test_auto_offline_needs_the_device_count_and_a_count_needs_auto():
    with pytest.raises(autopar.MeshError, match="devices=8"):
        autopar.plan(MLP(), (torch.randn(4, 16),), mesh="auto")
    with pytest.raises(autopar.MeshError, match="goes with mesh='auto'"):
        autopar.plan(MLP(), (torch.randn(4, 16),), mesh=(2, 2), devices=4)


@pytest.mark.slow  # two compiles and a third solve
def test_compile_with_auto_runs_the_mesh_rank_0_chose(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, x = MLP().eval(), torch.randn(8, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(model, (x,), mesh="auto", device="cpu")
            with pytest.raises(autopar.MeshError, match="pass example inputs"):
                autopar.compile(model, mesh="auto")
        assert pm.plan.mesh.shape == (1,) and [c.shape for c in pm.plan.mesh_candidates] == [(1,)]
        torch.testing.assert_close(pm(x), model(x))
        assert pm.solve_count == 0  # the inputs compile saw were planned by the mesh choice
        y = torch.randn(5, 16)  # a new signature is planned as with a given mesh
        torch.testing.assert_close(pm(y), model(y))
        assert pm.solve_count == 1
        with pytest.raises(autopar.OptionsError, match="cost_model='profile' measures on one mesh"):
            autopar.compile(model, (x,), mesh="auto", cost_model="profile")
    finally:
        dist.destroy_process_group()
