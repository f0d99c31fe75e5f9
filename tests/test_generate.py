"""Generation with a static KV cache on gloo ranks against one device.

Greedy tokens equal transformers' own `model.generate(..., do_sample=False)` on one
device for tiny GPT-2, Llama and Mistral (grouped-query attention), with the cache's
layout as the solver chooses it and with it split by force (by KV heads; by batch x
heads), so that the local cache update is exercised: its decode plan moves nothing on
the edges that carry a new cache value. Each run makes exactly two plans (prefill,
decode) for prompts of two lengths and two batch sizes. Seeded sampling equals the same
sampler on one device (Generator.single_device). A batch over the cache's, a prompt over
the prefill length and a prompt + new tokens - 1 over the cache raise CacheLimitError
naming the dim and the limit; a non-int length or top_k, or ranks asking for different
lengths, raise InputMismatchError on every rank; all leave the cache as it was. The
longest request the cache holds runs and equals transformers' tokens.

One spawn of 4 ranks runs the quick set (Llama and Mistral, meshes (1, 4) and (2, 2));
the rest of the grid and the 8-rank (2, 4) case are slow-marked."""

from __future__ import annotations

import warnings

import pytest
import torch

from autopar.core.errors import (CacheLimitError, CacheReleasedError, InputMismatchError, MeshError,
                                 UnsupportedModelError)
from autopar.core.placement import Partial, R, Shard
from autopar.runtime.generation import Generator
from autopar.runtime.kv_cache import CacheShape
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


def case_generate(rank: int, world: int, family: str, mesh: tuple, cache_layout=None, extras: bool = False) -> dict:
    """Compile once, generate greedily for both prompts; with `extras`, then sample with a
    seeded generator and send the three bad requests, on the same Generator."""
    import autopar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = autopar.compile_for_generation(tiny_lm(family), mesh=mesh, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE,
                                             prefill_len=PREFILL, cache_layout=cache_layout)
        agreed, calls = gen.step.agreed_calls, gen.step.calls
        out = {"tokens": [gen.generate(ids, NEW) for ids in prompts()]}
        out["step_agreements"] = (gen.step.agreed_calls - agreed, gen.step.calls - calls)
        if extras:
            out["sampled"] = gen.generate(prompts()[0], NEW, do_sample=True, temperature=0.8, top_k=20,
                                          generator=torch.Generator().manual_seed(7))
            out.update(_bad_requests(gen, rank))
            out["longest"] = gen.generate(longest_prompt(), MAX_CACHE - PREFILL + 1)  # fills the cache exactly
    pm = gen.step
    decode = next(c.plan for c in pm.programs if c.traced.inputs[-1].meta.shape == (1,))
    return {**out, "plans": len(pm.programs), "layout": str(pm.state_specs["key_cache_0"]),
            "local_cache": tuple(pm.state_tensors["key_cache_0"].shape),
            "full_cache": (gen.shape.batch, gen.shape.kv_heads, gen.shape.length, gen.shape.head_dim),
            "cache_moves": _cache_update_moves(decode, pm)}


def case_generate_from_book(rank: int, world: int, family: str, mesh: tuple, path: str, offline: str) -> dict:
    """A Generator's book of its two plans, saved, makes a second Generator that solves
    neither and generates the same tokens; so does the book autopar.plan_for_generation
    made in one process (`offline`)."""
    import autopar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = autopar.compile_for_generation(tiny_lm(family), mesh=mesh, max_batch=MAX_BATCH,
                                               max_cache_len=MAX_CACHE, prefill_len=PREFILL)
        if rank == 0:
            first.plan_book.to_json(path)
        torch.distributed.barrier()
        again = autopar.compile_for_generation(tiny_lm(family), mesh=mesh, max_batch=MAX_BATCH,
                                               max_cache_len=MAX_CACHE, prefill_len=PREFILL, plan=path)
        tokens = [again.generate(ids, NEW) for ids in prompts()]
        made_offline = autopar.compile_for_generation(tiny_lm(family), mesh=mesh, max_batch=MAX_BATCH,
                                                      max_cache_len=MAX_CACHE, prefill_len=PREFILL, plan=offline)
        offline_tokens = [made_offline.generate(ids, NEW) for ids in prompts()]
    return {"tokens": tokens, "offline_tokens": offline_tokens, "offline_solves": made_offline.step.solve_count,
            "solves": (first.step.solve_count, again.step.solve_count),
            "book": [p.digest() for p in first.plan_book.plans], "ran": [p.digest() for p in again.plan_book.plans],
            "layouts": (first.cache_layout, again.cache_layout)}


def _bad_requests(gen: Generator, rank: int) -> dict:
    pm = gen.step
    before = {n: t.clone() for n, t in pm.state_tensors.items() if "cache" in n}
    errors = []
    small = torch.zeros(1, 4, dtype=torch.long)
    for ids, new, kw in [(torch.zeros(3, 4, dtype=torch.long), 2, {}),     # batch over max_batch
                         (torch.zeros(1, 9, dtype=torch.long), 2, {}),     # prompt over prefill_len
                         (torch.zeros(1, 8, dtype=torch.long), 10, {}),    # prompt + new - 1 over max_cache_len
                         (small, 2.0, {}),                                 # not an int
                         (small, 2, dict(do_sample=True, top_k=2.0)),      # not an int
                         (small, 2 + rank % 2, {})]:                       # ranks ask for different lengths
        try:
            gen.generate(ids, new, **kw)
            errors.append(None)
        except InputMismatchError as e:
            errors.append(str(e))
    return {"errors": errors, "unchanged": all(torch.equal(before[n], pm.state_tensors[n]) for n in before)}


def longest_prompt() -> torch.Tensor:
    return torch.randint(0, 128, (1, PREFILL), generator=torch.Generator().manual_seed(2))


def _cache_update_moves(plan, pm) -> int:
    """Communicating steps on the edges that carry a new cache value to the output."""
    compiled = next(iter(pm.programs))
    updates = {u.index for u in compiled.traced.buffer_updates if "_cache_" in u.target and "length" not in u.target}
    return sum(1 for e in plan.edges if e.consumer == "output" and e.position in updates
               for step in e.steps if step.kind.communicates)


def reference_greedy(family: str) -> list[torch.Tensor]:
    model = tiny_lm(family)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [model.generate(ids, max_new_tokens=NEW, do_sample=False) for ids in prompts()]


def reference_sampled(family: str) -> torch.Tensor:
    """Our sampler on one device, without autopar, with the same seed."""
    ref = Generator.single_device(tiny_lm(family), MAX_BATCH, MAX_CACHE, PREFILL)
    return ref.generate(prompts()[0], NEW, do_sample=True, temperature=0.8, top_k=20,
                        generator=torch.Generator().manual_seed(7))


def check_greedy(results: list[dict], family: str, split: bool) -> None:
    """Every rank's tokens are transformers' greedy tokens on one device, from exactly two
    plans; a split cache is held in blocks and its update moves nothing."""
    want = reference_greedy(family)
    for rank, res in enumerate(results):
        assert res["plans"] == 2, f"rank {rank} made {res['plans']} plans"
        for got, ref in zip(res["tokens"], want):
            assert torch.equal(got, ref), f"{family} rank {rank} cache {res['layout']}:\n{got}\n!=\n{ref}"
        assert res["cache_moves"] == 0, res
        agreed, steps = res["step_agreements"]  # the request is agreed once; its steps follow from it
        assert agreed == 0 and steps == 2 * NEW, res["step_agreements"]
    if split:
        assert results[0]["local_cache"] != results[0]["full_cache"], results[0]["layout"]


# (family, mesh, cache layout or None for the solver's): one spawn of 4 ranks runs them all
QUICK = [("mistral", (2, 2), "S(0)S(1)")]
SLOW = [("llama", (1, 4), "RS(1)"), ("gpt2", (1, 4), None), ("gpt2", (2, 2), "S(0)S(1)"), ("llama", (2, 2), None),
        ("mistral", (1, 4), None), ("mistral", (2, 2), "S(0)R")]


@pytest.fixture(scope="module")
def quick_results():
    cases = [(case_generate, {"family": f, "mesh": m, "cache_layout": lay, "extras": f == "mistral"})
             for f, m, lay in QUICK]
    results = run_ranks(4, cases)
    return [[per_rank[i] for per_rank in results] for i in range(len(QUICK))]


@pytest.mark.parametrize("index", range(len(QUICK)), ids=[f"{f}-{m}-{lay or 'solver'}" for f, m, lay in QUICK])
def test_greedy_equals_one_device(quick_results, index):
    family, _, layout = QUICK[index]
    check_greedy(quick_results[index], family, split=layout is not None)


def test_seeded_sampling_equals_one_device_sampler(quick_results):
    want = reference_sampled("mistral")
    for rank, res in enumerate(quick_results[QUICK.index(("mistral", (2, 2), "S(0)S(1)"))]):
        assert torch.equal(res["sampled"], want), (rank, res["sampled"], want)


def test_bad_requests_are_refused_before_any_cache_write(quick_results):
    for res in quick_results[QUICK.index(("mistral", (2, 2), "S(0)S(1)"))]:
        batch, prompt, total, new, top_k, differ = res["errors"]
        assert batch is not None and "dim 0 (batch) = 3" in batch and "max_batch=2" in batch, batch
        assert prompt is not None and "dim 1 (prompt length) = 9" in prompt and "prefill_len=8" in prompt, prompt
        assert total is not None and "= 17 exceeds" in total and "max_cache_len=16" in total, total
        assert new is not None and "max_new_tokens=2.0 must be an int" in new, new
        assert top_k is not None and "top_k=2.0 must be an int" in top_k, top_k
        assert differ is not None and "different generations" in differ, differ
        assert res["unchanged"] and res["plans"] == 2


def test_the_longest_request_fills_the_cache_and_equals_one_device(quick_results):
    """prompt 8 + 9 new tokens writes positions 0..15 of a 16-long cache: allowed (one
    more token is refused above) and equal to transformers' greedy tokens."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = tiny_lm("mistral").generate(longest_prompt(), max_new_tokens=MAX_CACHE - PREFILL + 1, do_sample=False)
    for res in quick_results[QUICK.index(("mistral", (2, 2), "S(0)S(1)"))]:
        assert torch.equal(res["longest"], want), (res["longest"], want)


def test_release_cache_frees_the_full_cache():
    import gc
    import weakref
    from autopar.runtime.kv_cache import CachedLM
    cached = CachedLM(tiny_lm("llama"), MAX_BATCH, MAX_CACHE)
    full = weakref.ref(cached.cache.layers[0].keys)
    cached.release_cache()
    gc.collect()
    assert full() is None, "the full cache tensor is still referenced after release_cache"
    with pytest.raises(CacheReleasedError, match="release_cache"):
        cached(torch.zeros(MAX_BATCH, 1, dtype=torch.long), torch.tensor([0]))


def test_requests_outside_what_generation_does_are_refused_before_a_step():
    """On one process, with a step that records its calls: the typed error, and no call."""
    calls = []
    gen = Generator(lambda *a: calls.append(a), CacheShape(1, MAX_BATCH, 4, MAX_CACHE, 8), PREFILL)
    ids = torch.zeros(1, 4, dtype=torch.long)
    for kw, error, words in [(dict(input_ids=ids.int()), InputMismatchError, "2-d int64"),
                             (dict(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]])), InputMismatchError,
                              "attention_mask with zeros"),
                             (dict(input_ids=ids, max_new_tokens=0), InputMismatchError, "max_new_tokens >= 1")]:
        with pytest.raises(error, match=words) as caught:
            gen.generate(**{"max_new_tokens": 2, **kw})
        assert not isinstance(caught.value, CacheLimitError), caught.value
    assert calls == []
    for bad in (0, 2.0):
        with pytest.raises(CacheLimitError, match=f"prefill_len={bad}"):
            Generator(gen.step, gen.shape, bad)


def test_generation_errors_live_with_the_others():
    import autopar
    from autopar.runtime import generation
    assert generation.CacheLimitError is CacheLimitError is autopar.CacheLimitError
    assert autopar.PlanChangedWarning.__name__ == "PlanChangedWarning"
    from autopar.runtime.kv_cache import CachedLM
    with pytest.raises(UnsupportedModelError, match="not a transformers causal LM"):
        CachedLM(torch.nn.Linear(4, 4), MAX_BATCH, MAX_CACHE)


@pytest.mark.parametrize("layout", [(R, Shard(2)), (Shard(3), R), (R, Partial())])
def test_a_cache_layout_may_split_only_batch_or_heads(layout):
    from autopar.passes.plan.buffer_layouts import LocalBuffers
    with pytest.raises(MeshError, match="split only along dims"):
        LocalBuffers(("key_cache_0", "value_cache_0"), (0, 1), layout)
    assert LocalBuffers(("key_cache_0",), (0, 1), (Shard(0), Shard(1))).layout == (Shard(0), Shard(1))


@pytest.mark.slow
def test_greedy_equals_one_device_rest_of_grid():
    """The rest of the grid: the other families and meshes, the solver's layouts, a batch
    split, and Llama's cache split by KV heads on (1, 4)."""
    results = run_ranks(4, [(case_generate, {"family": f, "mesh": m, "cache_layout": lay}) for f, m, lay in SLOW])
    for i, (family, _, layout) in enumerate(SLOW):
        check_greedy([per_rank[i] for per_rank in results], family, split=layout is not None)


@pytest.mark.slow
def test_a_generators_plan_book_offline_or_saved_makes_both_plans_without_a_solve(tmp_path):
    import autopar
    path, offline = str(tmp_path / "book.json"), str(tmp_path / "offline.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.plan_for_generation(tiny_lm("llama"), mesh=(2,), max_batch=MAX_BATCH, max_cache_len=MAX_CACHE,
                                    prefill_len=PREFILL).to_json(offline)
    results = run_ranks(2, [(case_generate_from_book, {"family": "llama", "mesh": (2,), "path": path,
                                                       "offline": offline})])
    want = reference_greedy("llama")
    for rank, (res,) in enumerate(results):
        assert res["offline_solves"] == 0
        for got, ref in zip(res["offline_tokens"], want):
            assert torch.equal(got, ref), f"rank {rank}, the offline book:\n{got}\n!=\n{ref}"
        # rank 0 solved decode and prefill for the first Generator; nobody solves for the second
        assert res["solves"] == ((2, 0) if rank == 0 else (0, 0)), res["solves"]
        assert len(res["book"]) == 2 and res["ran"] == res["book"], res
        assert res["layouts"][0] == res["layouts"][1], res["layouts"]
        for got, ref in zip(res["tokens"], want):
            assert torch.equal(got, ref), f"rank {rank}:\n{got}\n!=\n{ref}"


@pytest.mark.slow
def test_greedy_equals_one_device_on_2x4():
    results = run_ranks(8, [(case_generate, {"family": "mistral", "mesh": (2, 4), "cache_layout": "S(0)S(1)"})])
    check_greedy([per_rank[0] for per_rank in results], "mistral", split=True)


# ---- in one process: the layout choice and the local update, offline (no ranks) --------

@pytest.fixture(scope="module")
def traced_decode():
    from autopar.passes.plan.planning import trace_for_planning
    from autopar.runtime.kv_cache import CachedLM
    cached = CachedLM(tiny_lm("llama"), MAX_BATCH, MAX_CACHE).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_for_planning(cached, (torch.zeros(MAX_BATCH, 1, dtype=torch.long), torch.tensor([0])))
    return cached, traced


def test_solver_picks_the_cheapest_cache_layout_and_keeps_a_split_update_local(traced_decode):
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.buffer_layouts import LocalBuffers, candidate_layouts, plan_local_buffers
    from autopar.passes.plan.planning import plan_annotated
    cached, traced = traced_decode
    mesh, opts = Mesh((1, 4)), Options(training=False)
    meta = next(gi.meta for gi in traced.inputs if gi.target == "key_cache_0")
    # batch 2 does not divide 4 ways: replicated, or split by the 4 KV heads
    assert candidate_layouts(meta, mesh, (0, 1)) == [(R, R), (R, Shard(1))]
    tried = []

    def solve(graph):
        plan = plan_annotated(graph, opts)
        tried.append((graph.node("b_key_cache_0").strategies[0].outputs[0].placements, plan))
        return plan

    local = LocalBuffers(tuple(cached.cache_names()), (0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        best = plan_local_buffers(traced, mesh, opts, None, local, solve)
    assert [layout for layout, _ in tried] == [(R, R), (R, Shard(1))]
    assert best.total_s == min(p.total_s for _, p in tried)
    split = dict(tried)[(R, Shard(1))]
    updates = {u.index for u in traced.buffer_updates if u.target in local.names}
    into_output = [e for e in split.edges if e.consumer == "output" and e.position in updates]
    assert len(into_output) == len(updates) == 4
    assert all(str(split.node("output").inputs[e.position]) == "RS(1)" and not e.steps for e in into_output)


def test_a_cache_layout_that_does_not_split_evenly_is_refused(traced_decode):
    from autopar.api import _cache_layout
    from autopar.core.errors import MeshError
    from autopar.core.mesh import Mesh
    cached, _ = traced_decode
    for text, mesh in [("S(0)R", (1, 4)), ("RS(0)", (1, 4)), ("S(1)", (1, 4))]:  # idle axis, 2 rows / 4, 1 axis
        with pytest.raises(MeshError, match="cache_layout"):
            _cache_layout(text, cached, Mesh(mesh))
    assert _cache_layout("RS(1)", cached, Mesh((1, 4))) is not None


def test_the_simulator_stores_a_local_cache_update_as_the_runtime_does(traced_decode):
    """passes/emit.buffer_blocks, shared by the runtime and the simulator: a cache update
    the plan keeps split (RS(1)) is the rank's block already, not cut again."""
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.buffer_layouts import LocalBuffers, plan_local_buffers
    from autopar.passes.plan.planning import plan_annotated
    from autopar.runtime.kv_cache import CachedLM
    from autopar.tools.simulated import simulate_against
    cached, traced = traced_decode
    opts = Options(training=False)
    local = LocalBuffers(tuple(cached.cache_names()), (0, 1), layout=(R, Shard(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_local_buffers(traced, Mesh((1, 4)), opts, None, local, lambda g: plan_annotated(g, opts))
        assert str(plan.node("output").inputs[traced.buffer_updates[0].index]) == "RS(1)"
        fresh = CachedLM(tiny_lm("llama"), MAX_BATCH, MAX_CACHE).eval()  # the traced one's layers hold export's fakes
        simulate_against(fresh, (torch.tensor([[5], [7]]), torch.tensor([2])), {}, traced, plan)
