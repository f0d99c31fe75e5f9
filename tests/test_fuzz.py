"""Fuzzed equivalence: random small models and meshes, compiled and checked against
the single-device model. The bulk runs in the lockstep simulator (passes/
simulate_mesh.py) under hypothesis with a fixed seed; a sample runs on real gloo ranks.
bench/fuzz_equivalence.py runs hundreds of cases."""

from __future__ import annotations

import copy
import random
import warnings

import torch
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.placement import local_chunk
from autopar.passes.planning import plan_traced
from autopar.passes.simulate_mesh import simulate
from autopar.passes.trace import trace
from tests import cases, fuzz_models
from tests.harness import run_ranks


def check_simulated(spec: dict) -> None:
    model, x = fuzz_models.build(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, (x,))
        plan = plan_traced(traced, Mesh(spec["mesh"]), Options(device=fuzz_models.device_for(spec)))[1]
    check_plan_simulated(model, x, traced, plan, context=str(spec))


def check_plan_simulated(model, x, traced, plan, context: str = "") -> None:
    """Every simulated rank's output and local parameter gradients (loss: mean of the
    squared output) equal the single-device ones."""
    ref = copy.deepcopy(model)
    ref_out = ref(x)
    (ref_out ** 2).mean().backward()
    outs, leaves = simulate(traced, plan, dict(model.named_parameters()), [x])
    torch.autograd.backward([(o[0] ** 2).mean() for o in outs])
    ref_grads = dict(ref.named_parameters())
    for r, o in enumerate(outs):
        torch.testing.assert_close(o[0], ref_out.detach(), msg=lambda m: f"rank {r} output, {context}: {m}")
        coords = plan.mesh.coords(r)
        for gi in traced.inputs:
            if gi.kind == "parameter":
                want = local_chunk(ref_grads[gi.target].grad, plan.node(gi.name).outputs[0], plan.mesh.shape, coords)
                torch.testing.assert_close(leaves[r][gi.target].grad, want,
                                           msg=lambda m: f"rank {r} grad {gi.target}, {context}: {m}")


@seed(20261130)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.randoms(use_true_random=False))
def test_fuzzed_models_match_in_simulation(rng):
    check_simulated(fuzz_models.random_spec(rng))


def test_fuzzed_sample_on_gloo_ranks():
    rng = random.Random(7)
    specs = [s for s in (fuzz_models.random_spec(rng) for _ in range(40)) if Mesh(s["mesh"]).size == 4][:5]
    results = run_ranks(4, [(cases.fuzz_on_ranks, dict(specs=specs))])
    for rank, (res,) in enumerate(results):
        for spec, case in zip(specs, res["cases"]):
            torch.testing.assert_close(case["out"], case["ref"], msg=lambda m: f"rank {rank}, {spec}: {m}")
            for name, (got, want) in case["grads"].items():
                torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} grad {name}, {spec}: {m}")
