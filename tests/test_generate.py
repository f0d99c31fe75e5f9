"""Generation with a static KV cache on gloo ranks against one device.

Greedy tokens equal transformers' own `model.generate(..., do_sample=False)` on one
device for tiny GPT-2, Llama and Mistral (grouped-query attention) on meshes (1, 4) and
(2, 2), with the cache's layout as the solver chooses it and with it split by force (by
KV heads, and by batch x heads), so that the local cache update is exercised. Each run
makes exactly two plans (prefill, decode) for prompts of two lengths and two batch
sizes. Seeded sampling equals the same sampler on one device (Generator.single_device).
A prompt longer than the cache and a batch larger than the cache's raise CacheLimitError
naming the dim and the limit, and leave the cache as it was."""

from __future__ import annotations

import warnings

import pytest
import torch

from autopar.runtime.generation import CacheLimitError, Generator
from tests.harness import run_ranks

MAX_BATCH, MAX_CACHE, PREFILL, NEW = 2, 16, 8, 5


def tiny_lm(family: str) -> torch.nn.Module:
    """2 layers, hidden 64, vocab 128, random weights from a fixed seed; no end-of-sequence
    token, so transformers' generate runs every step as ours does."""
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM)
    torch.manual_seed(0)
    if family == "gpt2":
        # a wider initialisation than GPT-2's 0.02, whose tiny random model repeats one token
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                           initializer_range=0.3, bos_token_id=0, eos_token_id=None))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    else:  # grouped-query attention: 8 query heads share 4 KV heads
        model = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                                 sliding_window=64))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 6), generator=gen), torch.randint(0, 128, (1, 3), generator=gen)]


def case_greedy(rank: int, world: int, family: str, mesh: tuple, cache_layout=None) -> dict:
    import autopar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = autopar.compile_for_generation(tiny_lm(family), mesh=mesh, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE,
                                             prefill_len=PREFILL, cache_layout=cache_layout)
        tokens = [gen.generate(ids, NEW) for ids in prompts()]
    pm = gen.step
    return {"tokens": tokens, "plans": len(pm.programs), "layout": str(pm.state_specs["key_cache_0"]),
            "local_cache": tuple(pm.state_tensors["key_cache_0"].shape),
            "full_cache": (gen.shape.batch, gen.shape.kv_heads, gen.shape.length, gen.shape.head_dim)}


def case_sampling(rank: int, world: int, family: str, mesh: tuple) -> dict:
    import autopar
    ids = prompts()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = autopar.compile_for_generation(tiny_lm(family), mesh=mesh, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE,
                                             prefill_len=PREFILL)
        sampled = gen.generate(ids, NEW, do_sample=True, temperature=0.8, top_k=20,
                               generator=torch.Generator().manual_seed(7))
    return {"sampled": sampled}


def case_bad_input(rank: int, world: int, family: str, mesh: tuple) -> dict:
    import autopar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = autopar.compile_for_generation(tiny_lm(family), mesh=mesh, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE,
                                             prefill_len=PREFILL)
    pm = gen.step
    before = {n: t.clone() for n, t in pm.state_tensors.items() if "cache" in n}
    errors = []
    for ids, new in [(torch.zeros(3, 4, dtype=torch.long), 2),     # batch over max_batch
                     (torch.zeros(1, 9, dtype=torch.long), 2),     # prompt over prefill_len
                     (torch.zeros(1, 8, dtype=torch.long), 9)]:    # prompt + new over max_cache_len
        try:
            gen.generate(ids, new)
            errors.append(None)
        except CacheLimitError as e:
            errors.append(str(e))
    unchanged = all(torch.equal(before[n], pm.state_tensors[n]) for n in before)
    return {"errors": errors, "unchanged": unchanged, "plans": len(pm.programs)}


def reference_greedy(family: str) -> list[torch.Tensor]:
    model = tiny_lm(family)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [model.generate(ids, max_new_tokens=NEW, do_sample=False) for ids in prompts()]


def _check_greedy(results: list, family: str, expect_split: bool) -> None:
    want = reference_greedy(family)
    for rank, (res,) in enumerate(results):
        assert res["plans"] == 2, f"rank {rank} made {res['plans']} plans"
        for got, ref in zip(res["tokens"], want):
            assert torch.equal(got, ref), f"{family} rank {rank} cache {res['layout']}:\n{got}\n!=\n{ref}"
    if expect_split:  # each rank holds a block of the cache, not all of it
        first = results[0][0]
        assert first["local_cache"] != first["full_cache"], first["layout"]


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_greedy_equals_one_device_on_1x4_and_2x2(family):
    """One spawn of 4 ranks: (1, 4) with the solver's cache layout, (1, 4) with the cache
    split by KV heads, (2, 2) split by batch x heads."""
    runs = [("solver", (1, 4), None), ("heads", (1, 4), "RS(1)"), ("batch x heads", (2, 2), "S(0)S(1)")]
    results = run_ranks(4, [(case_greedy, {"family": family, "mesh": mesh, "cache_layout": layout})
                            for _, mesh, layout in runs])
    for i, (name, _, layout) in enumerate(runs):
        _check_greedy([[r[i]] for r in results], family, expect_split=layout is not None)


def test_sampling_equals_one_device_sampler_and_bad_input_is_refused():
    results = run_ranks(4, [(case_sampling, {"family": "mistral", "mesh": (2, 2)}),
                            (case_bad_input, {"family": "llama", "mesh": (1, 4)})])
    ref = Generator.single_device(tiny_lm("mistral"), MAX_BATCH, MAX_CACHE, PREFILL)
    want = ref.generate(prompts()[0], NEW, do_sample=True, temperature=0.8, top_k=20,
                        generator=torch.Generator().manual_seed(7))
    for rank, (sampled, bad) in enumerate(results):
        assert torch.equal(sampled["sampled"], want), (rank, sampled["sampled"], want)
        batch, prompt, total = bad["errors"]
        assert batch is not None and "dim 0 (batch) = 3" in batch and "max_batch=2" in batch, batch
        assert prompt is not None and "dim 1 (prompt length) = 9" in prompt and "prefill_len=8" in prompt, prompt
        assert total is not None and "= 17" in total and "max_cache_len=16" in total, total
        assert bad["unchanged"] and bad["plans"] == 2


@pytest.mark.slow
def test_greedy_equals_one_device_on_2x4():
    results = run_ranks(8, [(case_greedy, {"family": "mistral", "mesh": (2, 4)})])
    _check_greedy(results, "mistral", expect_split=False)
