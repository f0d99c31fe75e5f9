"""Profiling cost model: measured compute (cached), calibrated links, and costs that
really drive the plan."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cost_models.profile import Profile, fit_alpha_beta
from autopar.passes.plan.planning import load_profile
from autopar.runtime.measure import profile_compute, samples_of, save_profile
from autopar.core.mesh import Mesh
from autopar.passes.strategies.strategies import annotate
from autopar.passes.trace.trace import trace
from tests import cases
from tests.harness import run_ranks
from tests.models import MLP


def test_profiler_measures_matmul_and_elementwise_and_reuses_its_cache(tmp_path):
    model = MLP((16, 64, 16)).eval()
    graph = annotate(trace(model, (torch.randn(8, 16),)), Mesh((2, 2)))
    samples = samples_of(graph, (2, 2))
    profile = Profile("cpu")
    measured = profile_compute(samples, profile, torch.device("cpu"), progress=False)
    assert measured == len(samples) > 0
    assert any(k.startswith("aten.linear.default|") for k in profile.compute)
    assert any(k.startswith("aten.relu.default|") for k in profile.compute)
    assert all(v > 0 for v in profile.compute.values())
    path = str(tmp_path / "profile.json")
    save_profile(profile, path)
    again = load_profile(path)
    assert again.compute == profile.compute
    assert profile_compute(samples, again, torch.device("cpu"), progress=False) == 0  # nothing re-measured
    assert again.backward == {}  # an inference plan's profile times no backward


def test_a_training_profile_times_each_ops_backward_and_the_cost_model_reads_it(tmp_path):
    from autopar.cost_models.model import CostModel
    model = MLP((16, 64, 16)).train()
    graph = annotate(trace(model, (torch.randn(8, 16),)), Mesh((2, 2)))
    samples = samples_of(graph, (2, 2))
    profile = Profile("cpu")
    assert profile_compute(samples, profile, torch.device("cpu"), progress=False, backward=True) == len(samples)
    assert set(profile.backward) == set(profile.compute)  # linear and relu all have a backward
    assert all(v >= 0 for v in profile.backward.values())
    path = str(tmp_path / "profile.json")
    save_profile(profile, path)
    again = load_profile(path)
    assert again.backward == profile.backward
    assert profile_compute(samples, again, torch.device("cpu"), progress=False, backward=True) == 0
    # the cost model prices a training op as (forward + measured backward) x contention
    costs = CostModel.analytic("cpu", (2, 2), training=True)
    measured = replace(costs, compute_table=lambda *a: 2.0, backward_table=lambda *a: 5.0, compute_scale=3.0)
    unmeasured = replace(measured, backward_table=lambda *a: None)
    node = next(n for n in graph.nodes if n.call is not None and n.strategies)
    s = node.strategies[0]
    target = node.call.target
    assert measured.op_cost(target, s.inputs, s.outputs).compute_s == pytest.approx((2.0 + 5.0) * 3.0)
    from autopar.cost_models.compute import backward_factor
    factor = backward_factor(target, tuple(measured.local(o) for o in s.outputs))
    assert unmeasured.op_cost(target, s.inputs, s.outputs).compute_s == pytest.approx(2.0 * (1 + factor) * 3.0)


@pytest.mark.gpu
def test_profiler_times_ops_on_cuda():
    # CUDA ops are timed with events after a synchronise; every sample must replay there
    model = MLP((16, 64, 16)).eval()
    graph = annotate(trace(model, (torch.randn(8, 16),)), Mesh((2, 2)))
    samples = samples_of(graph, (2, 2))
    profile = Profile("cuda")
    assert profile_compute(samples, profile, torch.device("cuda"), progress=False) == len(samples) > 0
    assert all(v > 0 for v in profile.compute.values())


def test_fit_recovers_alpha_and_beta():
    alpha, beta, n = 50e-6, 1e-9, 4
    sizes = [4096, 65536, 1 << 20, 1 << 24]
    seconds = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta for s in sizes]
    fit = fit_alpha_beta(sizes, seconds, n, "all_reduce")
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6) and fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fit["residual"] < 1e-9


@pytest.mark.slow  # times every collective kind on both axes of 4 ranks, up to 32 MiB
def test_calibration_on_4_gloo_ranks(tmp_path):
    path = str(tmp_path / "profile.json")
    results = run_ranks(4, [(cases.calibrate_links, dict(mesh=(2, 2), path=path)),
                            (cases.calibrate_links, dict(mesh=(2, 2), path=path))])
    first, second = results[0]
    comm = first["comm"]
    assert set(comm) == {f"{a}:{k}" for a in (0, 1) for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                               "all_to_all")}
    for key, fit in comm.items():
        assert 0 < fit["alpha_s"] < 0.1 and 0 < fit["beta_s_per_byte"] < 1e-6, (key, fit)
        assert fit["ranks"] == 2 and fit["residual"] < 1.0, (key, fit)
    assert "links measured" in first["note"]
    assert second["comm"] == comm  # the cached calibration is reused, not measured again
    assert first["sync_s"] is not None and 0 <= first["sync_s"] < 1.0
    assert second["sync_s"] == first["sync_s"]
    # the first plan's program was timed whole on rank 0, once: the second compile reuses it
    assert len(first["program_factor"]) == 1 and 0.1 < next(iter(first["program_factor"].values())) < 20
    assert second["program_factor"] == first["program_factor"]
    for res in (first, second):
        torch.testing.assert_close(*res["out"])


def _profile_with_links(alpha_s: float, beta: float) -> Profile:
    comm = {f"{a}:{k}": {"alpha_s": alpha_s, "beta_s_per_byte": beta, "residual": 0.0, "ranks": 4}
            for a in (0, 1) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    return Profile("synthetic", comm=comm)


def test_the_profile_drives_the_plan(tmp_path):
    model = MLP((256, 1024, 256, 1024, 256)).eval()
    x = torch.randn(64, 256)
    plans = {}
    for name, (alpha, beta) in {"dear": (1.0, 1e-3), "cheap": (1e-12, 1e-15)}.items():
        path = str(tmp_path / f"{name}.json")
        p = _profile_with_links(alpha, beta)
        p.device = "cpu"
        save_profile(p, path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[name] = autopar.plan(model, (x,), mesh=(1, 4), cost_model="saved", profile_path=path)
    dear, cheap = plans["dear"], plans["cheap"]
    assert dear.collectives() == () and dear.comm_s == 0  # replicated: no communication at all
    assert len(cheap.collectives()) > 0
    sharded = lambda p: sum(1 for n in p.nodes if n.kind.is_input and not n.outputs[0].is_replicated())  # noqa: E731
    assert sharded(cheap) > sharded(dear)
    assert "profile of cpu" in dear.cost_note and "missing" in dear.cost_note


def test_saved_without_a_file_plans_from_the_profile_shipped_for_the_device(tmp_path, monkeypatch):
    from autopar.core.errors import OptionsError
    from autopar.cost_models import shipped
    monkeypatch.setattr(shipped, "PROFILES_DIR", str(tmp_path))
    model = MLP((256, 1024, 256, 1024, 256)).eval()
    x = torch.randn(64, 256)
    with pytest.raises(OptionsError, match=r"none is shipped for 'h100' \(shipped: none yet\)"):
        autopar.plan(model, (x,), mesh=(1, 4), cost_model="saved", device="h100")
    p = _profile_with_links(1e-12, 1e-15)  # links cheap enough that the plan splits
    p.device = "NVIDIA H100 80GB HBM3"
    save_profile(p, str(tmp_path / "h100.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (x,), mesh=(1, 4), cost_model="saved", device="h100")
        analytic = autopar.plan(model, (x,), mesh=(1, 4), device="h100")
    assert "profile of NVIDIA H100 80GB HBM3" in plan.cost_note
    assert "the profile autopar ships: h100.json" in plan.cost_note
    assert plan.total_s != analytic.total_s  # priced by the profile's links, not the preset's
    with pytest.raises(OptionsError, match=r"none is shipped for 'h200' \(shipped: h100\)"):
        autopar.plan(model, (x,), mesh=(1, 4), cost_model="saved", device="h200")


def test_each_collective_call_pays_the_wait_for_ranks_sharing_cores():
    """CostModel.collective_sync_s is added once per collective call, forward and
    backward; a grad sync's backward goes into a gradient bucket (one wait per bucket,
    not per parameter) and local steps never wait."""
    from autopar.core.kinds import StepKind
    from autopar.core.resharding import Step
    from autopar.cost_models.model import CostModel
    base = CostModel.analytic("cpu", (4,), training=True)
    synced = replace(base, collective_sync_s=0.25)
    local = 4096
    diff = lambda kind, backward: (synced.step_s(Step(kind, 0, dim=0, backward=backward), local, True)  # noqa: E731
                                   - base.step_s(Step(kind, 0, dim=0, backward=backward), local, True))
    assert diff(StepKind.ALL_GATHER, StepKind.REDUCE_SCATTER) == pytest.approx(0.5)
    assert diff(StepKind.SLICE, StepKind.ALL_GATHER) == pytest.approx(0.25)
    assert diff(StepKind.ALL_REDUCE, StepKind.IDENTITY) == pytest.approx(0.25)
    assert diff(StepKind.GRAD_SYNC, StepKind.ALL_REDUCE) == 0.0
    inference = replace(synced, training=False)
    assert (inference.step_s(Step(StepKind.ALL_GATHER, 0, dim=0, backward=StepKind.REDUCE_SCATTER), local, True)
            - replace(base, training=False).step_s(Step(StepKind.ALL_GATHER, 0, dim=0), local, True)
            == pytest.approx(0.25))


def test_the_profile_keeps_its_sync_figure_and_a_dear_one_steers_the_plan(tmp_path):
    model = MLP((256, 1024, 256, 1024, 256)).eval()
    x = torch.randn(64, 256)
    plans = {}
    for name, sync_s in {"free": 0.0, "dear": 1.0}.items():
        p = _profile_with_links(1e-12, 1e-15)
        p.device, p.collective_sync_s = "cpu", sync_s
        path = str(tmp_path / f"{name}.json")
        save_profile(p, path)
        assert load_profile(path).collective_sync_s == sync_s
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[name] = autopar.plan(model, (x,), mesh=(1, 4), cost_model="saved", profile_path=path)
    assert len(plans["free"].collectives()) > 0
    assert plans["dear"].collectives() == ()  # every collective would wait a second
    assert "per collective" in plans["dear"].cost_note
    older = Profile("cpu").to_dict()
    del older["collective_sync_s"]  # a file written before the figure existed: measured again
    assert Profile.from_dict(older).collective_sync_s is None


def test_ops_inside_a_program_are_priced_with_its_measured_factor(tmp_path):
    """Profile.program_factor scales every op of its graph, mesh and mode (and nothing
    else): a factor of 2 doubles the plan's compute, and the note says so."""
    from autopar.cost_models.profile import program_key
    from autopar.passes.plan.planning import trace_for_planning
    model = MLP((256, 1024, 256)).train()
    x = torch.randn(64, 256)
    traced = trace_for_planning(model, (x,))
    plans = {}
    for factor in (1.0, 2.0):
        p = _profile_with_links(1e-12, 1e-15)
        p.device = "cpu"
        p.program_factor = {program_key(traced.fingerprint, (1, 4), True): factor,
                            program_key(traced.fingerprint, (1, 4), False): 5.0}  # another mode: not read
        path = str(tmp_path / f"x{factor}.json")
        save_profile(p, path)
        assert load_profile(path).program_factor == p.program_factor
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[factor] = autopar.plan(model, (x,), mesh=(1, 4), cost_model="saved", profile_path=path, training=True)
    assert plans[2.0].compute_s == pytest.approx(2 * plans[1.0].compute_s)
    assert "inside the rank program" in plans[2.0].cost_note and "inside" not in plans[1.0].cost_note
    older = Profile("cpu").to_dict()
    del older["program_factor"]  # a file written before the factor existed
    assert Profile.from_dict(older).program_factor == {}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_sharded_rank_program_runs_alone_with_stand_in_collectives(family):
    """What calibrate_program times: coordinate 0's program of a (2, 4) plan that shards
    (every collective kind the plan uses), forward and backward, on one process with
    no process group; its outputs have the shapes the in-process mesh simulator gives
    rank 0."""
    from autopar.passes.plan.planning import plan_traced, trace_for_planning
    from autopar.passes.lower.simulate_mesh import simulate
    from autopar.passes.trace.trace import flatten_inputs
    from autopar import _compat
    from autopar.runtime.measure import program_alone, time_program
    from autopar.passes.plan.state_layouts import whole_state
    from autopar.tools.simulated import CHEAP_COMM
    from tests.models import build, inputs
    model = build(family).train()
    args, kwargs = inputs(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_for_planning(model, args, kwargs)
        plan = plan_traced(traced, Mesh.of((2, 4)), autopar.Options(device=CHEAP_COMM, training=True))[1]
    assert len({s.kind for c in plan.edges for s in c.steps if s.kind.communicates}) >= 2
    state, user = whole_state(model), flatten_inputs(args, kwargs)[0]
    gm, ins, leaves = program_alone(traced, plan, torch.device("cpu"), state, user, training=True)
    assert leaves and all(t.requires_grad for t in leaves)
    alone = [t for t in _compat.tree_flatten(gm(*ins))[0] if isinstance(t, torch.Tensor)]
    simulated = simulate(traced, plan, state, user, traced.constants)[0][0]
    assert [t.shape for t in alone] == [t.shape for t in simulated]
    assert 0 < time_program(traced, plan, torch.device("cpu"), state, user, training=True) < 10


def test_the_shipped_h200_profile_predicts_the_step_measured_on_the_h200():
    """cost_models/profiles/h200.json, measured by bench/gpu_suite.sh on a lent H200, plans
    the suite's model offline on the meta device (traced here, by this torch); its predicted
    training step is held against the step the suite measured there (bench/results/
    gpu_suite_h200.txt, 'measured step'), within the suite's own target band 0.8-1.25."""
    import importlib.util
    import re
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("bench_gpu_profile",
                                                  Path(__file__).parents[1] / "bench" / "gpu_profile.py")
    script = importlib.util.module_from_spec(spec)  # a bench script, loaded by its path
    spec.loader.exec_module(script)
    llama = script.llama
    record = (Path(__file__).parents[1] / "bench" / "results" / "gpu_suite_h200.txt").read_text()
    measured_s = float(re.search(r"measured step ([\d.]+) ms", record).group(1)) / 1e3
    model = llama(4, 1024, torch.device("meta"))
    ids = torch.zeros(8, 512, dtype=torch.int64, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (), {"input_ids": ids, "labels": ids}, mesh=(1,), cost_model="saved",
                            device="h200", training=True)
    assert "profile of NVIDIA H200" in plan.cost_note and "the profile autopar ships: h200.json" in plan.cost_note
    assert "inside the rank program (measured" in plan.cost_note
    assert 0.8 <= plan.total_s / measured_s <= 1.25, (plan.total_s, measured_s, plan.cost_note)
