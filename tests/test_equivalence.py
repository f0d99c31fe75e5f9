"""The backbone: the parallel program on real gloo ranks against the single-device
model. Outputs with torch.testing.assert_close's fp32 defaults (rtol 1.3e-6, atol
1e-5); gradients likewise. Cases are batched so each world size spawns once."""

from __future__ import annotations

import pytest
import torch

from tests import cases
from tests.harness import run_ranks

MODELS = ["mlp", "gpt2", "llama", "bert"]
MESHES_4 = [(1, 4), (4, 1), (2, 2)]


@pytest.fixture(scope="module")
def four_ranks():
    batch = [(cases.forward_equivalence, dict(model=m, mesh=mesh)) for mesh in MESHES_4 for m in MODELS]
    batch += [(cases.gradient_equivalence, dict(model=m, mesh=(2, 2))) for m in MODELS]
    batch += [(cases.forward_equivalence, dict(model="mlp", mesh=(4, 1), device="cpu", batch=4096))]
    batch += [(cases.lazy_signatures, dict(mesh=(2, 2)))]
    results = run_ranks(4, batch)
    return {_key(fn, kw): [r[i] for r in results] for i, (fn, kw) in enumerate(batch)}


@pytest.fixture(scope="module")
def eight_ranks():
    batch = [(cases.forward_equivalence, dict(model=m, mesh=(2, 4))) for m in MODELS]
    batch += [(cases.gradient_equivalence, dict(model=m, mesh=(2, 4))) for m in MODELS]
    results = run_ranks(8, batch)
    return {_key(fn, kw): [r[i] for r in results] for i, (fn, kw) in enumerate(batch)}


def _key(fn, kw):
    return (fn.__name__,) + tuple(sorted((k, v) for k, v in kw.items()))


def _check_forward(per_rank):
    for rank, res in enumerate(per_rank):
        assert len(res["parallel"]) == len(res["reference"])
        for got, want in zip(res["parallel"], res["reference"]):
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank}: {m}")


def _check_gradients(per_rank):
    for rank, res in enumerate(per_rank):
        torch.testing.assert_close(res["loss"], res["ref_loss"])
        assert res["grads"], "no parameter gradients were compared"
        for name, (got, want, spec) in res["grads"].items():
            assert got is not None, f"rank {rank}: {name} ({spec}) got no gradient"
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank}: grad of {name} ({spec}): {m}")


@pytest.mark.parametrize("mesh", MESHES_4)
@pytest.mark.parametrize("model", MODELS)
def test_forward_matches_single_device_4_ranks(four_ranks, model, mesh):
    per_rank = four_ranks[_key(cases.forward_equivalence, dict(model=model, mesh=mesh))]
    _check_forward(per_rank)


@pytest.mark.parametrize("model", MODELS)
def test_forward_matches_single_device_on_2x4(eight_ranks, model):
    per_rank = eight_ranks[_key(cases.forward_equivalence, dict(model=model, mesh=(2, 4)))]
    _check_forward(per_rank)
    assert per_rank[0]["sharded_params"] > 0, "the cheap-communication plan should shard something"


@pytest.mark.parametrize("model", MODELS)
def test_gradients_match_on_2x2(four_ranks, model):
    _check_gradients(four_ranks[_key(cases.gradient_equivalence, dict(model=model, mesh=(2, 2)))])


@pytest.mark.parametrize("model", MODELS)
def test_gradients_match_on_2x4(eight_ranks, model):
    _check_gradients(eight_ranks[_key(cases.gradient_equivalence, dict(model=model, mesh=(2, 4)))])


def test_default_cost_model_data_parallel_run(four_ranks):
    per_rank = four_ranks[_key(cases.forward_equivalence, dict(model="mlp", mesh=(4, 1), device="cpu", batch=4096))]
    _check_forward(per_rank)
    assert per_rank[0]["collectives"] and all("-> output" in c for c in per_rank[0]["collectives"])


def test_lazy_compile_plans_per_signature(four_ranks):
    per_rank = four_ranks[_key(cases.lazy_signatures, dict(mesh=(2, 2)))]
    for res in per_rank:
        assert res["plans"] == 2
        for got, want in res["outputs"].values():
            torch.testing.assert_close(got, want)
