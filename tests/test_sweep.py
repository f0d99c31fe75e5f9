"""The sweep (autopar/tools/sweep.py): tiny configs made from transformers' defaults,
and its CI slice, a fixed sample of architectures over the families run in the in-process
mesh simulator against one device (outputs and every parameter gradient).

The sample runs on a 4-way mesh (a 1-D mesh keeps each ILP to about a second; the (2, 4)
sweep of every architecture is `python bench/sweep.py`). QUICK, one per family, is in the
quick set; the whole SAMPLE is marked slow. An architecture in PASSING that stops passing
fails here; KNOWN_FAILING lists the ones that fail today, with the cause."""

from __future__ import annotations

import warnings

import pytest
import torch

from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from autopar.tools.simulated import CHEAP_COMM, Reference, reference_run
from autopar.tools.sweep import (NOT_AUTOPARS, Outcome, Stage, SweepOptions, SweepResult, _simulate_and_compare,
                                 _Stopped, check_architecture, sweep)
from autopar.tools.sweep_configs import (HIDDEN, VOCAB, Task, architectures, example_inputs, special_token_ids,
                                         tiny_config)
from autopar.tools.sweep_report import summary, to_json

MESH = (4,)
# (task, model_type) -> the family it stands for
SAMPLE = {
    (Task.CAUSAL_LM, "llama"): "dense, GQA, RoPE",
    (Task.CAUSAL_LM, "gpt2"): "dense, learned positions, Conv1D",
    (Task.CAUSAL_LM, "qwen2"): "dense, biased q/k/v",
    (Task.CAUSAL_LM, "phi3"): "dense, fused qkv and gate/up",
    (Task.CAUSAL_LM, "bloom"): "dense, ALiBi",
    (Task.CAUSAL_LM, "falcon"): "dense, parallel attention and MLP",
    (Task.CAUSAL_LM, "mistral"): "sliding window",
    (Task.CAUSAL_LM, "gemma2"): "sliding window alternating with global, soft-capping",
    (Task.CAUSAL_LM, "mixtral"): "mixture of experts",
    (Task.CAUSAL_LM, "qwen2_moe"): "mixture of experts with a shared expert",
    (Task.CAUSAL_LM, "olmoe"): "mixture of experts, q/k norm",
    (Task.CAUSAL_LM, "deepseek_v3"): "multi-head latent attention, grouped routing",
    (Task.CAUSAL_LM, "minicpm3"): "multi-head latent attention, dense",
    (Task.CAUSAL_LM, "mamba"): "state space",
    (Task.CAUSAL_LM, "jamba"): "state space and attention hybrid, experts",
    (Task.CAUSAL_LM, "recurrent_gemma"): "linear recurrence, local attention",
    (Task.SEQ2SEQ, "t5"): "encoder-decoder, relative positions",
    (Task.SEQ2SEQ, "bart"): "encoder-decoder, learned positions",
    (Task.MASKED_LM, "bert"): "encoder",
    (Task.IMAGE_CLASSIFICATION, "vit"): "vision transformer",
    (Task.IMAGE_CLASSIFICATION, "convnext"): "convolutional vision",
}
# architecture -> why it fails today (none: the three the slice-write backward stopped pass)
KNOWN_FAILING: dict[str, str] = {}
PASSING = [key for key in SAMPLE if key[1] not in KNOWN_FAILING]
# one per task, of families tests/test_zoo_simulated.py does not already run in the quick set
# (encoder-decoders are in the quick set already: tests/test_zoo_simulated.py runs t5 and bart)
QUICK = [(Task.CAUSAL_LM, "mamba"), (Task.IMAGE_CLASSIFICATION, "convnext")]


def _check(task: Task, arch: str) -> SweepResult:
    options = SweepOptions(task=task, mesh=MESH, training=True, until=Stage.SIMULATE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_architecture(arch, architectures(task)[arch], options)


def _assert_passes(task: Task, arch: str) -> None:
    result = _check(task, arch)
    assert result.outcome is Outcome.PASS, f"{arch} ({SAMPLE[(task, arch)]}): {result.line()}\n{result.cause}"
    assert result.sharded_params > 0, f"{arch}: nothing sharded, so the simulator checked a replicated program"


@pytest.mark.parametrize("task, arch", QUICK, ids=[a for _, a in QUICK])
def test_sample_family_passes_in_the_simulator(task, arch):
    _assert_passes(task, arch)


@pytest.mark.slow
@pytest.mark.parametrize("task, arch", PASSING, ids=[a for _, a in PASSING])
def test_sample_architecture_keeps_passing(task, arch):
    _assert_passes(task, arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(KNOWN_FAILING))
def test_known_failing_architecture_still_fails(arch):
    """When one of these starts passing, move it to PASSING."""
    result = _check(Task.CAUSAL_LM, arch)
    if result.outcome is Outcome.PASS:
        pytest.fail(f"{arch} passes now: move it from KNOWN_FAILING to PASSING")
    assert result.against_autopar, result.line()


def test_quick_set_spans_the_families():
    assert set(QUICK) <= set(PASSING)
    assert {task for task, _ in QUICK} >= {Task.CAUSAL_LM, Task.IMAGE_CLASSIFICATION}


# ---- tiny configs ------------------------------------------------------------------

def test_tiny_config_shrinks_widths_layers_experts_and_vocabulary():
    c = tiny_config("mixtral")
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (HIDDEN, 2, VOCAB)
    assert c.hidden_size == c.num_attention_heads * c.head_dim
    assert (c.num_local_experts, c.num_experts_per_tok) == (4, 2)
    assert c.num_key_value_heads < c.num_attention_heads  # grouped-query attention stays grouped


def test_tiny_config_keeps_one_layer_of_each_kind():
    c = tiny_config("gemma3_text")
    assert set(c.layer_types) == {"sliding_attention", "full_attention"}
    assert c.sliding_window < 8  # shorter than the example sequence, so the window masks


def test_multi_head_latent_attention_stays_consistent():
    c = tiny_config("deepseek_v3")
    assert c.qk_head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim
    assert c.head_dim == c.qk_rope_head_dim  # the rotary embedding's width


def test_special_tokens_move_inside_the_vocabulary_and_out_of_the_inputs():
    c = tiny_config("gpt2")  # bos/eos 50256 by default
    assert c.eos_token_id < VOCAB
    ids = example_inputs(Task.CAUSAL_LM, c, "GPT2LMHeadModel")["input_ids"]
    assert not set(ids.flatten().tolist()) & special_token_ids(c)


# ---- the sweep's own behaviour -------------------------------------------------------

def test_a_timeout_is_a_row_and_the_sweep_goes_on():
    lines: list[str] = []
    results = sweep(SweepOptions(mesh=MESH, limit_s=0.05), only=["llama", "gpt2"], progress=lines.append)
    assert [(r.arch, r.category) for r in results] == [("llama", "timeout"), ("gpt2", "timeout")]
    assert len(lines) == 2 and "timeout" in lines[0]


def test_failures_outside_autopar_are_counted_apart():
    rows = [SweepResult("a", "A", Outcome.PASS, None, times_s={"export": 0.5, "plan": 1.0}, sharded_params=3),
            SweepResult("b", "B", Outcome.ERROR, Stage.CONFIG, "ValueError: no"),
            SweepResult("c", "C", Outcome.ERROR, Stage.SINGLE_DEVICE, "RuntimeError: no"),
            SweepResult("d", "D", Outcome.ERROR, Stage.EXPORT, "TraceError: torch.export could not trace"),
            SweepResult("e", "E", Outcome.MISMATCH, Stage.SIMULATE, "AssertionError: rank 0 output 0"),
            SweepResult("f", "F", Outcome.ERROR, Stage.PLAN, "SolverError: infeasible", times_s={"plan": 3.0})]
    assert [r.against_autopar for r in rows] == [False, False, False, False, True, True]
    assert {r.stage for r in rows if r.stage in NOT_AUTOPARS} == {Stage.CONFIG, Stage.SINGLE_DEVICE}
    options = SweepOptions(mesh=MESH)
    text = summary(rows, options)
    assert "simulate-mismatch" in text and "torch.export failures: 1" in text and "1 of 3" in text
    data = to_json(rows, options)
    assert data["counts"]["export"] == 1 and data["stage_times_s"]["plan"]["max"] == 1.0
    assert [r["category"] for r in data["results"]] == ["pass", "config", "single-device", "export",
                                                        "simulate-mismatch", "plan"]


# ---- the float64 re-check of an fp32 mismatch ---------------------------------------

class _Mlp(torch.nn.Module):
    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.up, self.down, self.noisy = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), noisy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        return y + torch.randn_like(y) if self.noisy else y  # noise: a different result every run


def _mlp_case(noisy: bool):
    torch.manual_seed(0)
    model, kwargs = _Mlp(noisy).train(), {"x": torch.randn(8, 16)}
    traced = trace(model, (), kwargs)
    plan = plan_traced(traced, Mesh.of(MESH), Options(device=CHEAP_COMM))[1]
    return model, kwargs, traced, plan


def test_an_fp32_only_difference_passes_when_float64_matches():
    model, kwargs, traced, plan = _mlp_case(noisy=False)
    ref = reference_run(model, (), kwargs, training=True)
    assert _simulate_and_compare(model, kwargs, traced, plan, ref, SweepOptions(mesh=MESH)) is False
    off = Reference(tuple(t + 1e-4 for t in ref.outputs), ref.grads)  # what rounding would look like at fp32
    assert _simulate_and_compare(model, kwargs, traced, plan, off, SweepOptions(mesh=MESH)) is True


def test_a_difference_that_float64_keeps_is_a_mismatch():
    model, kwargs, traced, plan = _mlp_case(noisy=True)
    ref = reference_run(model, (), kwargs, training=True)
    with pytest.raises(_Stopped) as stopped:
        _simulate_and_compare(model, kwargs, traced, plan, ref, SweepOptions(mesh=MESH))
    assert stopped.value.outcome is Outcome.MISMATCH and "in float64 too" in stopped.value.cause


class _OwnFloat32(torch.nn.Module):
    """Parts computed in float32 whatever the model's dtype, each way models write it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x).float()
        scale = torch.arange(8, dtype=torch.float) / 8
        p = torch.softmax(h * scale, dim=-1, dtype=torch.float32)
        return p.to(torch.float32).type(torch.float32).to(x.dtype)


def test_float64_math_runs_a_models_own_float32_parts_in_float64():
    from autopar.tools.float64_check import float64_math, in_float64
    model, kwargs = in_float64(_OwnFloat32(), {"x": torch.randn(4, 8)})
    x = kwargs["x"]
    low = model(x)
    with float64_math():
        high = model(x)
        traced = trace(model, (x,), {})
    exact = torch.softmax(model.proj(x) * (torch.arange(8, dtype=torch.float64) / 8), dim=-1)
    assert high.dtype is torch.float64 and torch.equal(high, exact)
    assert (low - exact).abs().max() > 1e-12, "the model no longer rounds in float32 outside the mode"
    dtypes = {a for n in traced.gm.graph.nodes for a in [*n.args, *n.kwargs.values()] if isinstance(a, torch.dtype)}
    assert torch.float32 not in dtypes, "a float32 cast was traced"


def test_per_stage_dropout_lists_are_zeroed():
    """CvT's drop_path_rate is a per-stage list ([0.0, 0.0, 0.1] by default): its last
    stage's stochastic depth draws torch.rand in training, so the sweep's loss differed
    from one device on every mesh. Every rate in such a list is zeroed, like a float rate."""
    from autopar.tools.sweep_configs import shrink
    c = tiny_config("cvt")
    assert c.drop_path_rate == [0.0, 0.0, 0.0]
    assert c.drop_rate == [0.0, 0.0, 0.0] and c.attention_drop_rate == [0.0, 0.0, 0.0]
    # a per-layer dropout list is zeroed and keeps the new layer count; other lists are left alone
    out = shrink({"num_hidden_layers": 4, "hidden_size": 256, "layer_dropout": [0.1, 0.2, 0.3, 0.4],
                  "kernel_sizes": [3, 3, 3, 3]})  # (rates are no layer kinds)
    assert out["layer_dropout"] == [0.0, 0.0] and out["num_hidden_layers"] == 2
    assert out["kernel_sizes"] == [3, 3]


@pytest.mark.parametrize("arch", ["wav2vec2", "parakeet_ctc"])
def test_speech_inputs_run_one_training_step(arch):
    """The speech sweep's inputs come from the model's main_input_name and config: raw
    waves long enough for the conv feature encoder (wav2vec2: the old 9 frames were
    shorter than the SpecAugment mask of 10), or (batch, frames, mel) input_features
    (parakeet); CTC heads get no labels (their loss cannot be exported). SpecAugment is
    off, so two training forwards give the same loss."""
    from autopar.tools.sweep_configs import Tiny
    model, kwargs = Tiny(arch, architectures(Task.SPEECH)[arch], Task.SPEECH, training=True).build()
    assert model.training and "labels" not in kwargs
    assert ("input_values" if arch == "wav2vec2" else "input_features") in kwargs
    if arch == "wav2vec2":
        assert not model.config.apply_spec_augment and model.config.mask_time_prob == 0.0
    else:
        assert kwargs["input_features"].dim() == 3 and "attention_mask" in kwargs
    from autopar.tools.simulated import loss_of
    losses = [loss_of(model(**kwargs)) for _ in range(2)]
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])
    losses[0].backward()


# ---- the slice on real ranks ---------------------------------------------------------

# two axes on four ranks: the 8-rank (2, 4) run of every family is bench/sweep.py --ranks
# (bench/results/sweep_ranks_2x4_training.txt); 8 ranks on this suite's 2 cores took 2.5 minutes
RANK_MESH = (2, 2)


@pytest.mark.slow
def test_the_sample_passes_on_four_gloo_ranks():
    """The same sample through the sweep's ranks stage (autopar/tools/sweep_ranks.py) in
    one set of 4 gloo ranks ((2, 2)): each architecture planned on rank 0, shipped, and
    trained against one device, outputs and every gradient. What the simulator passes
    must pass on ranks."""
    from autopar.tools.sweep_configs import Tiny
    from autopar.tools.sweep_ranks import RankJob, run_on_ranks
    jobs = [RankJob(Tiny(arch, architectures(task)[arch], task, training=True)) for task, arch in PASSING]
    results = run_on_ranks(jobs, RANK_MESH, limit_s=300, chunk=len(jobs))
    assert set(results) == {arch for _, arch in PASSING}
    failed = {a: f"{r.outcome.value}: {r.cause}" for a, r in results.items() if r.outcome is not Outcome.PASS}
    assert not failed, "\n".join(f"{a}: {why}" for a, why in failed.items())


@pytest.mark.slow
def test_a_failed_architecture_ends_its_ranks_and_fresh_ones_go_on(tmp_path):
    """An architecture that raises on the ranks is a row naming the rank and the error;
    the ranks are ended and new ones run the rest, which pass."""
    from autopar.tools.sweep_configs import Tiny
    from autopar.tools.sweep_ranks import RankJob, run_on_ranks
    missing = str(tmp_path / "no-such-plan.json")
    jobs = [RankJob(Tiny("gpt2", "GPT2LMHeadModel", Task.CAUSAL_LM, training=True), missing),
            RankJob(Tiny("llama", "LlamaForCausalLM", Task.CAUSAL_LM, training=True))]
    seen = []
    results = run_on_ranks(jobs, (2,), limit_s=120, progress=seen.append)
    assert [r.arch for r in seen] == ["gpt2", "llama"]
    assert results["gpt2"].outcome is Outcome.ERROR
    assert "PlanFileError" in results["gpt2"].cause and missing in results["gpt2"].cause
    assert results["gpt2"].cause.startswith("rank ")
    assert results["llama"].outcome is Outcome.PASS, results["llama"].cause


@pytest.mark.slow
def test_a_models_own_float32_parts_run_in_float64_in_the_rank_recheck():
    """Gemma 4 computes its norms, q/k/v projections and softmax in float32 whatever its
    dtype. On 4 ranks its fp32 gradients (the tied head's) miss fp32's tolerance by
    rounding; the re-check in float64 must run those parts in float64 too, or it keeps
    their 1e-7 rounding and calls the architecture a mismatch."""
    from autopar.tools.sweep_configs import Tiny
    from autopar.tools.sweep_ranks import RankJob, run_on_ranks
    jobs = [RankJob(Tiny("gemma4_text", "Gemma4ForCausalLM", Task.CAUSAL_LM, training=True))]
    result = run_on_ranks(jobs, (4,), limit_s=300)["gemma4_text"]
    assert result.outcome is Outcome.PASS, result.cause
    assert result.float64_only, "fp32 matched: the case no longer reaches the float64 re-check"
