"""Causal attention with its rows split along the sequence, balanced with the mirror rank
(autopar/core/causal.py): exact against the whole, priced as it runs, and emitted as a
module of the rank program. The gloo ranks run it in tests/test_equivalence.py
(test_context_parallel_matches: the "causal" model's cases)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import autopar
from autopar.core.causal import balanced_causal_rows, balanced_scores, causal_rows_attention, row_halves
from autopar.core.placement import R, Shard, Spec, TensorMeta, chunk_sizes
from autopar.cost_models.model import CostModel
from tests import models

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _ranks_in_threads(query, key, value, ways: int, enable_gqa: bool) -> list[torch.Tensor]:
    """Every rank's balanced rows, each rank a thread whose swap hands its rows to the
    mirror thread (the tensors, so one backward reaches every rank's queries)."""
    blocks = query.split([n for n in chunk_sizes(query.shape[-2], ways)], dim=-2)
    slots: list = [None] * ways
    outs: list = [None] * ways
    barrier = threading.Barrier(ways)

    def rank(c: int) -> None:
        def swap(rows: torch.Tensor, coming: int) -> torch.Tensor:
            slots[c] = rows
            barrier.wait()
            got = slots[ways - 1 - c]
            barrier.wait()
            assert got.shape[-2] == coming
            return got
        outs[c] = balanced_causal_rows(blocks[c], key, value, c, ways, 1, swap, enable_gqa=enable_gqa)

    threads = [threading.Thread(target=rank, args=(c,)) for c in range(ways)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


@pytest.mark.parametrize("length,ways,kv_heads", [(16, 4, 4), (10, 4, 2), (6, 4, 4), (17, 3, 1), (8, 2, 2),
                                                   (9, 8, 2)])
def test_balanced_rows_equal_whole_causal_attention(length, ways, kv_heads):
    # even, uneven (10 over 4: 3, 3, 3, 1), an empty last block (6 over 4), odd ways (the
    # middle rank is its own mirror), GQA; forward and every gradient
    g = torch.Generator().manual_seed(length * ways)
    q = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    gqa = kv_heads != 4
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    seed = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), seed)
    got = torch.cat(_ranks_in_threads(q, k, v, ways, gqa), dim=-2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), seed), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the masked form, which a rank alone computes, gives the same rows
    masked = [causal_rows_attention(c, ways, 1, b, k, v, enable_gqa=gqa)
              for c, b in enumerate(q.split(chunk_sizes(length, ways), dim=-2))]
    torch.testing.assert_close(torch.cat(masked, dim=-2), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ways", [2, 3, 4, 8])
def test_the_busiest_rank_computes_about_the_triangle_over_the_ranks(ways):
    half = 64
    length = 2 * ways * half
    # half-blocks c and 2 ways - 1 - c: (2 ways + 1) half^2 pairs on every rank
    assert balanced_scores(length, ways, 1) == (2 * ways + 1) * half * half
    masked = (length // ways) * length
    assert balanced_scores(length, ways, 1) / masked == pytest.approx((2 * ways + 1) / (4 * ways))
    assert row_halves(length, ways, 1, ways - 1) == (length - 2 * half, length - half, length)


def _specs(placements_q, mesh_ndim: int, length: int):
    q = TensorMeta((2, 8, length, 64), torch.bfloat16)
    kv = Spec((R,) * mesh_ndim, q)
    return (Spec(placements_q, q), kv, kv), (Spec(placements_q, q),)


def test_causal_attention_is_priced_as_its_kernel_runs():
    length = 16384  # FLOPs far above the launch overhead and the bytes
    whole_in, whole_out = _specs((R,), 1, length)
    one = CostModel.analytic("h100", (1,), training=True)
    full = one.op_cost(SDPA, whole_in, whole_out).compute_s
    triangle = one.op_cost(SDPA, whole_in, whole_out, causal=True).compute_s
    assert triangle == pytest.approx(full * (length + 1) / (2 * length), rel=0.02)

    # rows split on one axis: balanced, (2 w + 1) / (4 w) of the masked form, plus the swaps
    ins, outs = _specs((Shard(2),), 1, length)
    four = CostModel.analytic("h100", (4,), training=True)
    masked, balanced = four.op_cost(SDPA, ins, outs), four.op_cost(SDPA, ins, outs, causal=True)
    assert balanced.compute_s == pytest.approx(masked.compute_s * 9 / 16, rel=0.02)
    half_rows = 2 * 8 * (length // 8) * 64 * 2  # bytes of half a rank's queries (bf16)
    link = four.link(0)
    one_swap = 3 * link.alpha_s + half_rows * link.beta_s_per_byte
    assert balanced.comm_s == pytest.approx(4 * one_swap)  # queries there, results back; gradients twice
    assert balanced.total_s < masked.total_s

    # rows split on two axes: the masked form, no swap
    ins, outs = _specs((Shard(2), Shard(2)), 2, length)
    both = CostModel.analytic("h100", (2, 2), training=True)
    assert both.op_cost(SDPA, ins, outs, causal=True) == both.op_cost(SDPA, ins, outs)


def test_a_context_parallel_plan_prices_emits_and_saves_the_balanced_form(tmp_path):
    from autopar.core.errors import ProcessGroupError
    from autopar.passes.lower.emit import emit
    from autopar.passes.lower.program import CausalRowsModule
    from autopar.passes.plan.planning import trace_for_planning
    model = models.build("causal")
    args, kwargs = models.inputs("causal", batch=2, seq=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.hand_plan(model, args, kwargs, mesh=(4,), style="cp", device="h100")
    attention = [n for n in plan.nodes if n.op == "aten.scaled_dot_product_attention.default"]
    assert attention and all(n.causal and str(n.outputs[0]) == "S(2)" for n in attention)
    # the swaps are the plan's communication and evaluate() reproduces the plan's figures
    figures = autopar.evaluate(plan, device="h100")
    assert figures.compute_s == pytest.approx(plan.compute_s) and figures.comm_s == pytest.approx(plan.comm_s)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = autopar.Plan.from_json(path)
    assert [n.causal for n in again.nodes] == [n.causal for n in plan.nodes]
    assert autopar.evaluate(again, device="h100").total_s == pytest.approx(figures.total_s)

    program = emit(trace_for_planning(model, args, kwargs), plan, (1,)).gm
    modules = [m for m in program.modules() if isinstance(m, CausalRowsModule)]
    assert len(modules) == len(attention) and all(m.axis == 0 for m in modules)
    with pytest.raises(ProcessGroupError, match="balanced causal attention at node"):
        modules[0](*[torch.zeros(2, 4, 4, 8)] * 3)


def _attention_calls(traced) -> list:
    return [n for n in traced.gm.graph.nodes if n.target is SDPA]


def _calls_causal(sdpa) -> bool:
    """sdpa(q, k, v, attn_mask=None, dropout_p, is_causal=True), positionally or by keyword."""
    mask = sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("attn_mask")
    causal = sdpa.args[5] if len(sdpa.args) > 5 else sdpa.kwargs.get("is_causal", False)
    return mask is None and causal is True


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformers_explicit_causal_masks_become_is_causal(family):
    # traced, transformers builds the causal mask as ops (aranges, packed-sequence ids,
    # kv_pos <= q_pos): proven the triangle, the sdpa calls is_causal and the ops are gone;
    # the traced program still computes the model's logits
    from autopar.passes.trace.trace import trace
    model = models.build(family)
    args, kwargs = models.inputs(family, batch=2, seq=8)
    traced = trace(model, args, {"input_ids": kwargs["input_ids"]})
    calls = _attention_calls(traced)
    assert calls and all(_calls_causal(n) for n in calls), [(n.args[3:], n.kwargs) for n in calls]
    assert not any(n.target in (torch.ops.aten.le.Tensor, torch.ops.aten.cumsum.default) for n in traced.gm.graph.nodes)
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    feeds = [state[gi.target] if isinstance(gi.target, str) else kwargs["input_ids"] for gi in traced.inputs]
    with torch.no_grad():
        got = traced.gm(*feeds)[0]
        torch.testing.assert_close(got, model(input_ids=kwargs["input_ids"]).logits, rtol=1e-5, atol=1e-6)


def test_a_long_mask_is_proven_without_building_it():
    # 131072 tokens, batch 16, on the meta device: the [16, 1, L, L] mask (2.7e11 booleans)
    # is never made; each row's visible keys are an interval from the position vectors
    import time

    from autopar.passes.trace.trace import trace
    with torch.device("meta"):
        model = models.build("llama")
    ids = torch.zeros(16, 131072, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    calls = _attention_calls(trace(model, (), {"input_ids": ids}))
    assert calls and all(_calls_causal(n) for n in calls)
    assert time.perf_counter() - t0 < 60  # a guard against materialising the mask, not a timing target


@pytest.mark.parametrize("case", ["sliding window", "padding mask", "long sliding window"])
def test_masks_that_are_not_the_triangle_stay(case):
    # a window of 4 keys (Mistral's sliding window), short and on the meta device at 4096
    # tokens; a padding mask given as an input: the sdpa keeps its mask
    import transformers as T

    from autopar.passes.trace.trace import trace
    config = T.MistralConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, max_position_embeddings=8192, use_cache=False,
                             sliding_window=4)
    if case == "padding mask":
        model, args, kwargs = models.build("llama"), *models.inputs("llama", batch=2, seq=8)
        kwargs = {"input_ids": kwargs["input_ids"], "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    elif case == "sliding window":
        torch.manual_seed(0)
        model, kwargs = T.MistralForCausalLM(config).eval(), {"input_ids": torch.randint(1, 64, (2, 8))}
    else:
        with torch.device("meta"):
            model = T.MistralForCausalLM(config).eval()
        kwargs = {"input_ids": torch.zeros(2, 4096, dtype=torch.long, device="meta")}
    calls = _attention_calls(trace(model, (), kwargs))
    assert calls and not any(_calls_causal(n) for n in calls)
    assert all(isinstance(n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask"), torch.fx.Node) for n in calls)


class _SharedMask(torch.nn.Module):
    """Two attentions reading one 1 x 1 triangle (all true), the second with 4 queries; or
    one attention over 4096 positions, the first a NaN (not sorted: no query sees key 0),
    or boolean positions (no binary search on them)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, short: torch.Tensor, long: torch.Tensor) -> torch.Tensor:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if self.kind == "broadcast":
            mask = torch.ones(1, 1, dtype=torch.bool, device=short.device).tril()
            return sdpa(short, short, short, attn_mask=mask).sum() + sdpa(long, long, long, attn_mask=mask).sum()
        n = long.shape[-2]
        cols = torch.arange(n, device=long.device, dtype=torch.float32)
        if self.kind == "nan":  # key 0 is seen by no query, yet a binary search finds every row's end at i + 1
            cols, rows = cols.masked_fill(cols == 0, float("nan")), cols + 0.5
        else:
            cols, rows = cols > 0, cols > 0
        return sdpa(long, long, long, attn_mask=cols[None, :] <= rows[:, None]).sum()


@pytest.mark.parametrize("kind", ["broadcast", "nan", "bool"])
def test_a_mask_is_proven_for_each_attention_that_reads_it_and_refused_where_unproven(kind):
    # the 1 x 1 triangle is the 1-query attention's is_causal, not the 4-query one's; the
    # NaN and boolean positions (4096 x 4096, beyond what is evaluated whole) prove nothing
    from autopar.passes.trace.trace import trace
    n = 4 if kind == "broadcast" else 4096
    device = "cpu" if kind == "broadcast" else "meta"
    short, long = torch.randn(1, 2, 1, 8, device=device), torch.randn(1, 2, n, 8, device=device)
    calls = {n.args[0].meta["val"].shape[-2]: n for n in _attention_calls(trace(_SharedMask(kind), (short, long)))}
    assert not _calls_causal(calls[n])
    if kind == "broadcast":
        assert _calls_causal(calls[1])
