"""AutoparTrainer (autopar/tools/trainer.py): transformers' Trainer over a ParallelModule
on 2 gloo ranks, launched as torchrun would (accelerate sees 2 processes), against
Trainer over the same model on one device in this process: GPT-2, and Llama with
gradient accumulation over micro-batches of uneven labelled-token counts.

Tolerances are fp32's as in tests/test_training.py: losses and gradient norms at every
step at rtol 1e-5 (atol 1e-6), eval_loss at rtol 1e-5, the saved weights at
assert_close's fp32 defaults. The runs clip (max_grad_norm below the norms the models
start with) and decay weights on a tensor-parallel plan. Each of these moved the losses
past them when tried: clipping by one rank's norm, decaying the norms' weights, letting
accelerate split the batches, counting a causal LM's labels other than Trainer does.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import autopar
from autopar.cost_models.devices import register_preset
from autopar.tools.simulated import CHEAP_COMM
from tests import models
from tests.harness import run_ranks

STEPS = 5
BATCH = 4


def dataset(n: int, seed: int, masked: bool = False) -> list[dict[str, torch.Tensor]]:
    """Token rows labelled with themselves; `masked`: about a third of the labels -100, so
    the micro-batches of one step hold different numbers of labelled tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, 8), generator=g)
    labels = ids.masked_fill(torch.rand(n, 8, generator=g) < 0.35, -100) if masked else ids
    return [{"input_ids": row, "labels": lab} for row, lab in zip(ids, labels)]


def training_args(output_dir: str, **over):
    from transformers import TrainingArguments
    # adam_epsilon 1e-6: GPT-2's key bias has an exactly-zero true gradient, so its
    # updates are rounding noise blown up by a smaller eps (tests/cases.py train_steps)
    return TrainingArguments(output_dir=output_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                             max_steps=STEPS, learning_rate=1e-3, weight_decay=0.1, adam_epsilon=1e-6,
                             max_grad_norm=0.5, warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, **over)


def train(trainer) -> dict:
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {"loss": torch.tensor([e["loss"] for e in logs]), "grad_norm": torch.tensor([e["grad_norm"] for e in logs]),
            "lr": [e["learning_rate"] for e in logs], "logs": logs, "eval_loss": trainer.evaluate()["eval_loss"]}


# (model family, masked labels, gradient accumulation steps): GPT-2 as it comes; Llama,
# whose loss_type makes Trainer count labelled tokens past each row's first, over two
# micro-batches of uneven counts (Trainer's num_items_in_batch normalisation)
RUNS = {"gpt2": ("gpt2", False, 1), "llama_accumulated": ("llama", True, 2)}


def autopar_trainer_case(rank: int, world: int, out: str, run: str) -> dict:
    # what torchrun sets: accelerate then sees a multi-process CPU run (and would wrap the
    # model in DDP and give each rank half the batches, were AutoparTrainer not to stop it)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    register_preset(CHEAP_COMM)  # by name, so the plan's MFU has a peak to divide by
    family, masked, accumulate = RUNS[run]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # nearly free communication: the solver shards parameters (tensor parallelism),
        # so clipping and weight decay run on shards, not on replicas
        pm = autopar.compile(models.build(family).train(), mesh=(world,), device=CHEAP_COMM.name)
        trainer = autopar.AutoparTrainer(model=pm, args=training_args(out, gradient_accumulation_steps=accumulate),
                                         train_dataset=dataset(24, 3, masked), eval_dataset=dataset(8, 4, masked))
        result = train(trainer)
        trainer.save_model(os.path.join(out, run))
    sharded = sorted(k for k, s in pm.state_specs.items() if not s.is_replicated())
    return {**result, "world_size": trainer.args.world_size, "sharded": sharded}


def reference(run: str, out: str) -> tuple[dict, torch.nn.Module]:
    """The same run through transformers.Trainer on one device, in this process."""
    from transformers import Trainer
    family, masked, accumulate = RUNS[run]
    model = models.build(family).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=training_args(out, gradient_accumulation_steps=accumulate),
                          train_dataset=dataset(24, 3, masked), eval_dataset=dataset(8, 4, masked))
        return train(trainer), model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run -> (each rank's result, the reference's, the reference model, the saved folder)."""
    out = str(tmp_path_factory.mktemp("trainer"))
    ranks = run_ranks(2, [(autopar_trainer_case, dict(out=out, run=run)) for run in RUNS])
    return {run: ([r[i] for r in ranks], *reference(run, str(tmp_path_factory.mktemp("ref"))), os.path.join(out, run))
            for i, run in enumerate(RUNS)}


@pytest.mark.slow  # a 2-rank spawn of 2 runs, each traced and solved twice (train, eval), and the references: 25-40 s
@pytest.mark.parametrize("run", RUNS)
def test_trainer_on_two_ranks_matches_one_device(runs, run):
    ranks, ref, _, _ = runs[run]
    assert len(ref["loss"]) == STEPS
    assert ref["grad_norm"].min() > 0.5, "the reference should clip at every step, or clipping goes untested"
    for rank, got in enumerate(ranks):
        assert got["world_size"] == 2, "accelerate should see both processes, as under torchrun"
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(got["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} grad_norm: {m}")
        assert got["lr"] == pytest.approx(ref["lr"])
        assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    assert ranks[0]["sharded"], "the plan should shard some parameters, or this is plain data parallelism"


@pytest.mark.slow  # shares the spawn above
@pytest.mark.parametrize("run", RUNS)
def test_saved_weights_load_into_the_model_class(runs, run):
    _, _, ref_model, final = runs[run]
    loaded = type(ref_model).from_pretrained(final)
    want = ref_model.state_dict()
    for name, got in loaded.state_dict().items():
        torch.testing.assert_close(got, want[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # shares the spawn above
def test_step_metrics_reach_the_logs(runs):
    ranks, _, _, _ = runs["gpt2"]
    logs = ranks[0]["logs"]
    assert "autopar_mfu" not in logs[0]  # a step's metrics exist once the next one starts
    for entry in logs[1:]:
        assert entry["autopar_step_s"] > 0 and entry["autopar_tokens_per_s_per_device"] > 0
        assert entry["autopar_mfu"] > 0 and math.isfinite(entry["autopar_mfu"])  # of cheap-comm's made-up peak
        assert entry["autopar_peak_memory_mib"] > 1


@pytest.mark.parametrize("field, over", [("save_strategy", {}), ("torch_compile", {"torch_compile": True}),
                                         ("gradient_checkpointing", {"gradient_checkpointing": True})])
def test_arguments_autopar_replaces_are_refused_with_the_fix(tmp_path, field, over):
    from transformers import TrainingArguments
    from autopar.tools.trainer import check_args
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             **({"save_strategy": "no"} if field != "save_strategy" else {}), **over)
    with pytest.raises(autopar.TrainerError, match=f"TrainingArguments.{field} is not supported"):
        check_args(args)


def test_a_plain_model_is_refused():
    with pytest.raises(autopar.TrainerError, match=r"got Linear: pass model=autopar.compile\(model"):
        autopar.AutoparTrainer(model=torch.nn.Linear(2, 2))


def test_a_module_returning_split_outputs_is_refused():
    from autopar.core.options import Options
    from autopar.runtime.module import ParallelModule
    from autopar.tools.trainer import check_model
    pm = ParallelModule.__new__(ParallelModule)  # the guard reads these two fields only
    object.__setattr__(pm, "stages", None)
    object.__setattr__(pm, "options", Options(sharded_outputs=True))
    with pytest.raises(autopar.TrainerError, match="returns them split, as DTensors"):
        check_model(pm)


def test_a_logging_window_combines_steps_by_time():
    from autopar.runtime.metrics import StepMetrics, combined
    fast = StepMetrics(1.0, 100, 50.0, 1e9, 0.2, 10, "cpu")  # 2 devices: 100 tokens / 1 s / 2
    slow = StepMetrics(3.0, 100, 100 / 3 / 2, 1e9, 0.2 / 3, 30, "cpu")
    both = combined([fast, slow])
    assert (both.seconds, both.tokens, both.model_flops, both.peak_memory_bytes) == (4.0, 200, 2e9, 30)
    assert both.tokens_per_s_per_device == pytest.approx(200 / 4.0 / 2)  # not the mean of 50 and 16.7
    assert both.mfu == pytest.approx(0.1)
