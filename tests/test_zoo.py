"""Coverage: Hugging Face families beyond GPT-2, Llama and BERT, and a torchvision-style
CNN, each compiled on mesh (2, 4) and run on 8 real gloo ranks against the single-device
model: every output (logits and loss) at assert_close's fp32 defaults, and in training
every parameter gradient. One spawn for the whole zoo (tiny configs) keeps CI fast.

The plan is made with nearly free communication (tests/cases.py CHEAP_COMM), so the
solver shards everything its rules allow and every reshard path is exercised."""

from __future__ import annotations

import pytest
import torch

from tests import cases
from tests.harness import run_ranks

# one 8-rank spawn; every family is also checked in the quick set in the simulator
# (tests/test_zoo_simulated.py)
pytestmark = pytest.mark.slow

# (model, what it brings)
ZOO = [
    ("mistral-tiny", "GQA causal LM, 6 heads / 2 K/V heads (not divisible by 4), sliding window"),
    ("qwen2-tiny", "GQA with biased q/k/v"),
    ("gemma-tiny", "multi-query attention (1 K/V head), tied embeddings"),
    ("phi-tiny", "partial rotary embedding, parallel attention+MLP"),
    ("gpt-neox-tiny", "partial rotary, fused qkv"),
    ("opt-tiny", "learned positions, ReLU"),
    ("mixtral-tiny", "mixture of experts: top-2 routing over 4 experts"),
    ("t5-tiny", "encoder-decoder, relative position buckets"),
    ("bart-tiny", "encoder-decoder, learned positions"),
    ("roberta-tiny", "encoder, masked LM"),
    ("vit-tiny", "vision transformer: conv patch embedding"),
    ("resnet-group", "torchvision-style CNN with GroupNorm (training)"),
]
INFERENCE_ONLY = [("resnet-batch", "torchvision-style CNN with BatchNorm (inference: running statistics)")]


@pytest.fixture(scope="module")
def zoo_results():
    batch = [(cases.zoo_equivalence, dict(name=n, mesh=(2, 4))) for n, _ in ZOO]
    batch += [(cases.zoo_equivalence, dict(name=n, mesh=(2, 4), training=False)) for n, _ in INFERENCE_ONLY]
    results = run_ranks(8, batch)
    return {kw["name"]: [r[i] for r in results] for i, (_, kw) in enumerate(batch)}


@pytest.mark.parametrize("name", [n for n, _ in ZOO + INFERENCE_ONLY])
def test_zoo_model_matches_single_device_on_2x4(zoo_results, name):
    per_rank = zoo_results[name]
    for rank, res in enumerate(per_rank):
        assert len(res["parallel"]) == len(res["reference"]) > 0
        for got, want in zip(res["parallel"], res["reference"]):
            torch.testing.assert_close(got, want, msg=lambda m: f"{name} rank {rank} output: {m}")
        for param, (got, want, spec) in res["grads"].items():
            if want is None:
                assert got is None or not got.any(), f"{name} rank {rank}: {param} has a gradient it should not"
                continue
            assert got is not None, f"{name} rank {rank}: {param} ({spec}) got no gradient"
            torch.testing.assert_close(got, want, msg=lambda m: f"{name} rank {rank} grad of {param} ({spec}): {m}")
    assert per_rank[0]["sharded_params"] > 0, f"{name}: nothing was sharded"
    if name not in dict(INFERENCE_ONLY):
        assert per_rank[0]["grads"], f"{name}: no gradients compared"
