"""Plans made offline in one process, saved, and run on 8 gloo ranks with no rank solving:
a dynamic plan (one trace serves every size in its ranges) and a Generator's book of its
decode and prefill plans. (The pipelined plan file runs on 8 ranks in
tests/test_pipeline.py, case 6 of its spawn.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from tests import models
from tests.harness import run_ranks
from tests.test_dynamic import RANGES, WIDE, _check_pairs, from_plan_file
from tests.test_generate import MAX_BATCH, MAX_CACHE, NEW, PREFILL, prompts, reference_greedy, tiny_lm
from autopar.tools.simulated import CHEAP_COMM

MESH = (2, 4)


def generate_from_book(rank: int, world: int, path: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = autopar.compile_for_generation(tiny_lm("mistral"), mesh=MESH, max_batch=MAX_BATCH,
                                             max_cache_len=MAX_CACHE, prefill_len=PREFILL, plan=path)
        tokens = [gen.generate(ids, NEW) for ids in prompts()]
    return {"tokens": tokens, "solves": gen.step.solve_count, "ran": [p.digest() for p in gen.plan_book.plans],
            "layout": gen.cache_layout}


@pytest.mark.slow  # one 8-rank spawn
def test_offline_dynamic_and_generation_books_run_on_8_ranks_without_a_solve(tmp_path):
    dynamic, generation = str(tmp_path / "dynamic.json"), str(tmp_path / "generation.json")
    args, kwargs = models.inputs("gpt2", 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.plan(models.build("gpt2", **WIDE["gpt2"]), args, kwargs, mesh=MESH, device=CHEAP_COMM,
                     dynamic=RANGES).to_json(dynamic)
        book = autopar.plan_for_generation(tiny_lm("mistral"), mesh=MESH, max_batch=MAX_BATCH,
                                           max_cache_len=MAX_CACHE, prefill_len=PREFILL)
    book.to_json(generation)
    # sizes every split of a (2, 4) plan divides (a size it does not divide plans again, by design)
    sizes = dict(sizes=((8, 8), (16, 16), (8, 24)), local=(16, 8))
    results = run_ranks(8, [(from_plan_file, dict(path=dynamic, mesh=MESH, **sizes)),
                            (generate_from_book, dict(path=generation))])
    want = reference_greedy("mistral")
    for rank, (dyn, gen) in enumerate(results):
        _check_pairs(dyn, rank)
        assert (dyn["traces"], dyn["solves"], len(dyn["plans"])) == (1, 0, 1), (rank, dyn["plans"])
        assert gen["solves"] == 0 and gen["ran"] == [p.digest() for p in book.plans], (rank, gen)
        for got, ref in zip(gen["tokens"], want):
            assert torch.equal(got, ref), f"rank {rank} ({gen['layout']}):\n{got}\n!=\n{ref}"
