"""Fuzzed equivalence: random small models and meshes, compiled and checked against
the single-device model. The bulk runs in the lockstep simulator (passes/
simulate_mesh.py) under hypothesis with a fixed seed; a sample runs on real gloo ranks.
bench/fuzz_equivalence.py runs hundreds of cases."""

from __future__ import annotations

import random
import warnings

import torch
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from tests import cases, fuzz_models
from tests.harness import run_ranks
from autopar.tools.simulated import simulate_against


def check_simulated(spec: dict) -> None:
    model, x = fuzz_models.build(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, (x,))
        plan = plan_traced(traced, Mesh(spec["mesh"]), Options(device=fuzz_models.device_for(spec)))[1]
    check_plan_simulated(model, x, traced, plan, context=str(spec))


def check_plan_simulated(model, x, traced, plan, context: str = "") -> None:
    """Every simulated rank's output and local parameter gradients (loss: mean of the
    squared output) equal the single-device ones (autopar/tools/simulated.py)."""
    simulate_against(model, (x,), {}, traced, plan, context=context)


@seed(20261130)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.randoms(use_true_random=False))
def test_fuzzed_models_match_in_simulation(rng):
    check_simulated(fuzz_models.random_spec(rng))


def test_fuzzed_sample_on_gloo_ranks():
    rng = random.Random(7)
    specs = [s for s in (fuzz_models.random_spec(rng) for _ in range(40)) if Mesh(s["mesh"]).size == 4][:5]
    assert len(specs) == 5, f"40 draws gave only {len(specs)} specs for a 4-rank mesh"
    results = run_ranks(4, [(cases.fuzz_on_ranks, dict(specs=specs))])
    for rank, (res,) in enumerate(results):
        assert len(res["cases"]) == len(specs), f"rank {rank} ran {len(res['cases'])} of {len(specs)} cases"
        for spec, case in zip(specs, res["cases"]):
            torch.testing.assert_close(case["out"], case["ref"], msg=lambda m: f"rank {rank}, {spec}: {m}")
            assert case["grads"], f"rank {rank}, {spec}: no gradients compared"
            for name, (got, want) in case["grads"].items():
                torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} grad {name}, {spec}: {m}")
