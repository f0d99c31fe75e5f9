"""State of a pipelined model on gloo ranks: full_state_dict under the original names
(GPT-2's tied wte/lm_head under both), load_full_state_dict, and a training checkpoint
resumed into a fresh pipelined module and optimiser continuing bit for bit."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import autopar
from tests.harness import unwaited_collectives
from tests.models import build, inputs

STEPS, SAVED_AT, LR = 4, 2, 1e-3


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _batches() -> list[torch.Tensor]:
    ids = inputs("gpt2", batch=4)[1]["input_ids"]
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, ids.shape, generator=gen) for _ in range(STEPS)]


def _pipe(model: torch.nn.Module, schedule: str = "1f1b", microbatches: int = 2, mesh: tuple = (2, 2)):
    from autopar.tools.simulated import CHEAP_COMM  # cheap links: the stages shard over their sub-mesh
    ids = inputs("gpt2", batch=4)[1]["input_ids"]
    options = autopar.Options(pipeline_axis=0, microbatches=microbatches, pipeline_schedule=schedule, training=True,
                              device=CHEAP_COMM)
    pipe = autopar.compile(model, (), {"input_ids": ids}, mesh=mesh, options=options, loss_fn=lm_loss)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=LR)


def _train(pipe, opt, batches, root=None, first: int = 0) -> None:
    for step in range(first, len(batches)):
        opt.zero_grad()
        pipe.step(input_ids=batches[step], target=batches[step])
        opt.step()
        if root is not None and step + 1 == SAVED_AT:
            autopar.save_training_checkpoint(pipe, opt, root, SAVED_AT)


def state_case(rank: int, world: int, root: str) -> dict:
    """One device and the pipeline (2 microbatches) train alike; the pipeline then loads
    the one-device state; a pipeline of another schedule refuses its checkpoint."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, batches = build("gpt2", n_layer=2).train(), _batches()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for ids in batches:
        ref_opt.zero_grad()
        lm_loss(ref(input_ids=ids).logits, ids).backward()
        ref_opt.step()
    pipe, opt = _pipe(copy.deepcopy(model))
    _train(pipe, opt, batches, root)
    unwaited = unwaited_collectives()
    piped = pipe.full_state_dict()
    pipe.load_full_state_dict(ref.state_dict())
    other, other_opt = _pipe(copy.deepcopy(model), schedule="gpipe")
    try:
        autopar.resume(other, other_opt, root)
        refused = ""
    except autopar.CheckpointError as e:
        refused = str(e)
    return {"ref": {k: v.detach() for k, v in ref.state_dict().items()}, "piped": piped,
            "loaded": pipe.full_state_dict(), "refused": refused, "unwaited": unwaited}


def resume_case(rank: int, world: int, root: str, mesh: tuple = (2, 2), schedule: str = "gpipe",
                microbatches: int = 1) -> dict:
    """A fresh pipeline and optimiser resume step SAVED_AT and train on. DCP keeps one
    replica of each replicated block, so this is exact only while replicas stay bit-equal
    (autopar/runtime/buckets.py: microbatches accumulate as .grad += reduced)."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, batches = build("gpt2", n_layer=2).train(), _batches()
    pipe, opt = _pipe(copy.deepcopy(model), schedule, microbatches, mesh)
    _train(pipe, opt, batches, root)
    fresh, fresh_opt = _pipe(build("gpt2", n_layer=2, seed=1).train(), schedule, microbatches, mesh)
    manifest = autopar.resume(fresh, fresh_opt, root)
    _train(fresh, fresh_opt, batches, first=manifest.step)
    return {"uninterrupted": pipe.full_state_dict(), "resumed": fresh.full_state_dict(), "step": manifest.step}


def test_stage_names_map_to_the_original_and_the_stale_tied_alias_is_not_read():
    """torch's split keeps original names (older torch: '.'->'_'), moves Llama's
    non-persistent inv_freq into its stages, and aliases GPT-2's lm_head.weight into
    stage 0, whose graph never uses it."""
    from autopar.passes.plan.pipeline import microbatch_inputs
    from autopar.passes.plan.pipeline_stages import split_model
    from autopar.runtime.pipeline_state import name_table, original_name, read_names
    warnings.simplefilter("ignore")
    model = build("gpt2", n_layer=2)
    table = name_table(model)
    assert original_name("transformer_h_0_ln_1_weight", table) == "transformer.h.0.ln_1.weight"
    with pytest.raises(autopar.CheckpointError, match="matches no name of the original model"):
        original_name("nowhere.weight", table)
    args, kwargs = microbatch_inputs((), inputs("gpt2", batch=4)[1], 2)
    pipe = split_model(model, args, kwargs, ("transformer.h.1",))
    first, last = (pipe.get_stage_module(k) for k in range(2))
    assert "lm_head.weight" in first.state_dict() and "lm_head.weight" not in read_names(first)
    assert {"transformer.wte.weight", "lm_head.weight"} & read_names(first) == {"transformer.wte.weight"}
    assert "lm_head.weight" in read_names(last)
    llama = build("llama", num_hidden_layers=2)
    assert "model.rotary_emb.inv_freq" not in llama.state_dict()
    assert original_name("model.rotary_emb.inv_freq", name_table(llama)) == "model.rotary_emb.inv_freq"


@pytest.mark.slow
def test_pipelined_state_matches_one_device_and_resumes_exactly(tmp_path):
    """4 gloo ranks, one spawn (about 25 s): GPT-2 (tied wte/lm_head) in 2 stages on (2, 2),
    1F1B with 2 microbatches: against one device, and resumed bit for bit (each stage's two
    replicas accumulate the microbatches alike)."""
    from tests.harness import run_ranks
    results = run_ranks(4, [(state_case, dict(root=str(tmp_path / "a"))),
                            (resume_case, dict(root=str(tmp_path / "b"), schedule="1f1b", microbatches=2))])
    for rank, r in enumerate(results):
        out = r[0]
        ref = out["ref"]
        # each microbatch's backward reduces each gradient bucket once and waits for it
        # (a bucket left full from the previous backward relaunched at every hook, unwaited)
        assert out["unwaited"] == 0, f"rank {rank}: {out['unwaited']} collectives never waited"
        assert list(out["piped"]) == list(ref)  # every original name, in order, tied ones included
        for name, value in out["piped"].items():
            torch.testing.assert_close(value, ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert torch.equal(out["piped"]["lm_head.weight"], out["piped"]["transformer.wte.weight"])
        assert all(torch.equal(out["loaded"][n], ref[n]) for n in ref)
        assert "pipeline stages" in out["refused"] and "gpipe" in out["refused"]
        assert list(r[1]["resumed"]) == list(ref)
        _check_resumed(r[1], rank)


def _check_resumed(again: dict, rank: int) -> None:
    assert again["step"] == SAVED_AT and "lm_head.weight" in again["resumed"]
    for name, value in again["resumed"].items():
        assert torch.equal(value, again["uninterrupted"][name]), f"rank {rank}: {name}"


def test_load_full_state_dict_refuses_a_dict_missing_any_stages_name_before_loading_any():
    """Every rank refuses alike: a rank holding stage 0 only must not load a dict that lacks
    a name of stage 1, which the ranks holding stage 1 refuse."""
    from types import SimpleNamespace
    from autopar.runtime.pipeline_state import load_pipeline_state, name_table
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    loaded = []
    stage0 = SimpleNamespace(source_model=model[0], load_full_state_dict=loaded.append)
    full = {k: v for k, v in model.state_dict().items() if k != "1.bias"}
    originals = {k.removeprefix("0."): v for k, v in name_table(model).items()}  # stage 0's names: weight, bias
    originals.update(name_table(model))
    with pytest.raises(KeyError, match=r"lacks \['1.bias'\]"):
        load_pipeline_state([(0, stage0)], full, originals, {}, {})
    assert loaded == []
