"""The backbone: the parallel program on real gloo ranks against the single-device
model. Outputs with torch.testing.assert_close's fp32 defaults (rtol 1.3e-6, atol
1e-5); gradients likewise. Cases are batched so each world size spawns once."""

from __future__ import annotations

import pytest
import torch

from tests import cases
from tests.harness import run_ranks

# two spawns of many compiles each (minutes on 2 cores). The quick set checks every model
# family in the simulator (test_zoo_simulated.py) and the runtime on real gloo ranks
# (test_fuzz, test_training, test_runtime).
pytestmark = pytest.mark.slow

MODELS = ["mlp", "gpt2", "llama", "bert"]
MESHES_4 = [(1, 4), (4, 1), (2, 2)]
HAND_MODELS = ["gpt2", "llama"]
HAND_STYLES = ["data_parallel", "megatron", "dp_tp", "fsdp", "fsdp_tp"]
# what each hand style must have laid out: (an input, a column-parallel weight, a norm weight)
HAND_LAYOUTS = {
    "data_parallel": ("S(0)S(0)", "RR", "RR"),
    "megatron": ("RR", "S(d)S(d)", "RR"),
    "dp_tp": ("S(0)R", "RS(d)", "RR"),
    "fsdp": ("S(0)S(0)", "S(0)S(0)", "S(0)S(0)"),
    "fsdp_tp": ("S(0)R", "S(0)S(d)", "S(0)R"),  # Megatron on axis 1, each block's dim 0 split on axis 0
}


# context parallelism (hand styles in passes/plan/hand_plans.py): every attention's query
# rows split along the sequence, keys and values gathered, balanced: each rank computes its
# first half-block and its mirror's second (autopar/core/causal.py). "causal" calls sdpa with
# is_causal=True and GQA; llama and gpt2 build transformers' explicit mask, which the trace
# proves causal (passes/trace/causal_masks.py); 10 tokens over 4 ranks are blocks of 3, 3, 3, 1
CONTEXT_PARALLEL_4 = [dict(model="causal", mesh=(4,), style="cp", seq=10),
                      dict(model="llama", mesh=(4,), style="cp", seq=10),
                      dict(model="gpt2", mesh=(4,), style="cp", seq=8),
                      dict(model="causal", mesh=(4,), style="fsdp_cp", seq=8)]
CONTEXT_PARALLEL_8 = [dict(model="causal", mesh=(2, 4), style="dp_cp", seq=10),
                      dict(model="llama", mesh=(2, 4), style="tp_cp", seq=8)]
# expert parallelism (hand style ep, passes/plan/hand_plans.py): 8 routed experts, top-2,
# split over the last axis, each rank's tokens sent to their experts' ranks by
# all-to-all with uneven counts (autopar/runtime/experts.py); the (2, 4) cases are data
# parallel on axis 0 too. DeepSeek-V3 has a dense first layer and a shared expert
EXPERT_PARALLEL_4 = [dict(model=m, mesh=(4,), style="ep", batch=4) for m in ("mixtral", "qwen3_moe", "deepseek_v3")]
# the solver's own plan under 80 % of its unbounded memory: the layers are recomputed in
# backward, all-to-alls included (every rank recomputes them in one order)
EXPERT_RECOMPUTE = dict(model="qwen3_moe", mesh=(4,), batch=4, num_hidden_layers=2, budget=0.8)
EXPERT_PARALLEL_8 = [dict(model=m, mesh=(2, 4), style="ep", batch=4) for m in ("mixtral", "qwen3_moe", "deepseek_v3")]
# the attention layout each style pins
CONTEXT_LAYOUTS = {"cp": "S(2)", "fsdp_cp": "S(2)", "dp_cp": "S(0)S(2)", "tp_cp": "S(2)S(1)"}


@pytest.fixture(scope="module")
def four_ranks():
    batch = [(cases.forward_equivalence, dict(model=m, mesh=mesh)) for mesh in MESHES_4 for m in MODELS]
    batch += [(cases.gradient_equivalence, dict(model=m, mesh=(2, 2))) for m in MODELS]
    batch += [(cases.forward_equivalence, dict(model="mlp", mesh=(4, 1), device="cpu", batch=4096))]
    batch += [(cases.lazy_signatures, dict(mesh=(2, 2)))]
    batch += [(cases.gradient_equivalence, dict(model=m, mesh=(2, 2), batch=4, style=s))
              for m in HAND_MODELS for s in HAND_STYLES]
    batch += [(cases.vocab_parallel_embedding, dict(mesh=(2, 2)))]
    batch += [(cases.gradient_equivalence, dict(model="gpt2", mesh=(2, 2), n_layer=4))]
    batch += [(cases.gradient_equivalence, kw) for kw in CONTEXT_PARALLEL_4]
    batch += [(cases.gradient_equivalence, dict(model="llama", mesh="auto", batch=4))]
    batch += [(cases.gradient_equivalence, LOSS_ROWS)]
    batch += [(cases.gradient_equivalence, kw) for kw in EXPERT_PARALLEL_4 + [EXPERT_RECOMPUTE]]
    batch += [(cases.split_outputs_equivalence, kw) for kw, _ in SPLIT_OUTPUTS]
    results = run_ranks(4, batch)
    return {_key(fn, kw): [r[i] for r in results] for i, (fn, kw) in enumerate(batch)}


@pytest.fixture(scope="module")
def eight_ranks():
    batch = [(cases.forward_equivalence, dict(model=m, mesh=(2, 4))) for m in MODELS]
    batch += [(cases.gradient_equivalence, dict(model=m, mesh=(2, 4))) for m in MODELS]
    batch += [(cases.gradient_equivalence, kw) for kw in CONTEXT_PARALLEL_8]
    batch += [(cases.gradient_equivalence, kw) for kw in EXPERT_PARALLEL_8]
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


@pytest.mark.parametrize("style", HAND_STYLES)
@pytest.mark.parametrize("model", HAND_MODELS)
def test_hand_plans_run_and_match(four_ranks, model, style):
    # the hand plans priced in bench/plan_quality.py are real plans: on 4 gloo ranks the
    # loss and every gradient shard equal the single-device model's
    per_rank = four_ranks[_key(cases.gradient_equivalence, dict(model=model, mesh=(2, 2), batch=4, style=style))]
    _check_gradients(per_rank)
    placements = per_rank[0]["placements"]
    column = {"gpt2": ("p_transformer_h_0_mlp_c_fc_weight", "1"), "llama": ("p_model_layers_0_mlp_up_proj_weight", "0")}
    norm = {"gpt2": "p_transformer_h_0_ln_1_weight", "llama": "p_model_layers_0_input_layernorm_weight"}
    weight, out_dim = column[model]
    want_input, want_weight, want_norm = HAND_LAYOUTS[style]
    assert placements["input_0"] == want_input, placements["input_0"]
    assert placements[weight] == want_weight.replace("d", out_dim), placements[weight]
    assert placements[norm[model]] == want_norm, placements[norm[model]]


@pytest.mark.parametrize("kw", CONTEXT_PARALLEL_4 + CONTEXT_PARALLEL_8, ids=lambda kw: f"{kw['model']}-{kw['style']}-"
                         f"{'x'.join(map(str, kw['mesh']))}-seq{kw['seq']}")
def test_context_parallel_matches(four_ranks, eight_ranks, kw):
    per_rank = (four_ranks if len(kw["mesh"]) == 1 else eight_ranks)[_key(cases.gradient_equivalence, kw)]
    assert per_rank[0]["attention"] and all(a == CONTEXT_LAYOUTS[kw["style"]] for a in per_rank[0]["attention"]), \
        per_rank[0]["attention"]
    # causal rows split on one axis run balanced, half of them swapped with the mirror rank
    balanced = len(per_rank[0]["attention"])
    assert all(r["balanced"] == balanced for r in per_rank), [r["balanced"] for r in per_rank]
    _check_gradients(per_rank)


@pytest.mark.parametrize("kw", EXPERT_PARALLEL_4 + EXPERT_PARALLEL_8,
                         ids=lambda kw: f"{kw['model']}-{'x'.join(map(str, kw['mesh']))}")
def test_expert_parallel_matches(four_ranks, eight_ranks, kw):
    per_rank = (four_ranks if len(kw["mesh"]) == 1 else eight_ranks)[_key(cases.gradient_equivalence, kw)]
    split = "S(0)" if len(kw["mesh"]) == 1 else "RS(0)"
    assert per_rank[0]["experts"] and all(e == split for e in per_rank[0]["experts"]), per_rank[0]["experts"]
    assert all(r == "S(0)" * len(kw["mesh"]) for r in per_rank[0]["routed_rows"]), per_rank[0]["routed_rows"]
    _check_gradients(per_rank)
    # every rank held only its experts' weights and their gradients were its own
    expert_grads = [name for name in per_rank[0]["grads"] if ".experts." in name]
    assert expert_grads and all(per_rank[0]["grads"][n][2] == split for n in expert_grads)


def test_recomputed_expert_parallel_layers_match(four_ranks):
    per_rank = four_ranks[_key(cases.gradient_equivalence, EXPERT_RECOMPUTE)]
    assert per_rank[0]["experts"] and all(e == "S(0)" for e in per_rank[0]["experts"]), per_rank[0]["experts"]
    assert any(n.startswith("routed_experts") for n in per_rank[0]["recomputed"]), per_rank[0]["recomputed"]
    _check_gradients(per_rank)


def test_the_mesh_rank_0_chose_trains_like_one_device(four_ranks):
    # mesh="auto" on 4 ranks: rank 0 plans (4,) and (2, 2), every rank runs the cheaper
    per_rank = four_ranks[_key(cases.gradient_equivalence, dict(model="llama", mesh="auto", batch=4))]
    assert per_rank[0]["mesh_candidates"] == [(4,), (2, 2)]
    assert {res["mesh"] for res in per_rank} == {per_rank[0]["mesh"]}
    _check_gradients(per_rank)


# a mean loss is its sum over its count (passes/trace/mean_losses.py): a Llama returning
# its loss alone, the last 3 labels of each row ignored, computes each rank's rows of the
# loss (two partial sums) and trains like one device
LOSS_ROWS = dict(model="llama", mesh=(4,), batch=4, loss_only=True, ignored=3)


def test_loss_rows_split_over_ranks_match(four_ranks):
    per_rank = four_ranks[_key(cases.gradient_equivalence, LOSS_ROWS)]
    assert all(r["loss_rows"] == ["S(0)"] for r in per_rank), [r["loss_rows"] for r in per_rank]
    _check_gradients(per_rank)


# Options(sharded_outputs=True): the logits come back as a DTensor in the layout the plan
# made them (batch rows under data parallelism; vocabulary over both axes under Megatron),
# the loss whole; an objective reading both trains every parameter as on one device
SPLIT_OUTPUTS = [(dict(model="llama", mesh=(4,), style="data_parallel"), "S(0)"),
                 (dict(model="llama", mesh=(2, 2), style="megatron"), "S(2)S(2)")]


@pytest.mark.parametrize("kw,spec", SPLIT_OUTPUTS, ids=lambda x: x.get("style", "") if isinstance(x, dict) else x)
def test_outputs_left_split_come_back_as_dtensors_and_train(four_ranks, kw, spec):
    per_rank = four_ranks[_key(cases.split_outputs_equivalence, kw)]
    for rank, res in enumerate(per_rank):
        assert res["is_dtensor"] and res["loss_is_plain"] and res["spec"] == spec, (rank, res["spec"])
        assert res["verified"], (rank, res["report"])
        torch.testing.assert_close(res["local"], res["expected"], msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(res["whole"], res["ref_logits"], msg=lambda m: f"rank {rank}: {m}")
    _check_gradients(per_rank)


def test_vocab_parallel_embedding_matches(four_ranks):
    # the table split by vocabulary over both axes; each rank looks up only its rows
    # (passes/rules/local.py) and the partial sums are all-reduced
    per_rank = four_ranks[_key(cases.vocab_parallel_embedding, dict(mesh=(2, 2)))]
    assert per_rank[0]["weight"] == "S(0)S(0)" and per_rank[0]["embedding"] == "PP"
    _check_forward(per_rank)
    for rank, res in enumerate(per_rank):
        for name, (got, want, spec) in res["grads"].items():
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank}: grad of {name} ({spec}): {m}")


def test_clustered_plan_matches(four_ranks):
    # 4-layer GPT-2: the two inner layers share ILP variables (passes/strategies/clusters.py); the
    # plan they give runs and its loss and gradients equal the single-device model's
    per_rank = four_ranks[_key(cases.gradient_equivalence, dict(model="gpt2", mesh=(2, 2), n_layer=4))]
    assert per_rank[0]["shared_blocks"] == 1
    _check_gradients(per_rank)
