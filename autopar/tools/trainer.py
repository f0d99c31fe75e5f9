"""AutoparTrainer: transformers' Trainer training a ParallelModule.

    pm = autopar.compile(model, mesh=(2,))        # under torchrun, 2 ranks
    args = TrainingArguments("out", per_device_train_batch_size=8, save_strategy="no")
    trainer = autopar.AutoparTrainer(model=pm, args=args, train_dataset=ds)
    trainer.train()                               # every rank runs this same script
    trainer.save_model("out/final")               # full weights; from_pretrained loads them

Why a subclass: what has to change are decisions Trainer takes in its own methods
(accelerate's DistributedDataParallel wrap and per-process data split, the gradient
norm, the weight-decay names, what is saved). A TrainerCallback only sees events and
can change none of them; a prepare(trainer) helper would have to patch those same
methods onto one instance. Subclassing is the extension point Trainer documents
("subclass and override"); a user's own Trainer subclass can derive from this one
instead.

autopar wants the same full batch on every rank, splits it itself and synchronises
the gradients itself, so every rank runs the loop one process would run:

1. the model is neither wrapped in DistributedDataParallel nor moved: accelerate's
   guard against preparing a model twice is set on it;
2. the data loaders give every rank every batch: accelerate's per-process shard of the
   batch sampler is set to one process, and accelerate still seeds or synchronises the
   ranks' samplers alike, so they draw the same order (pm checks each call's shapes
   across ranks, not its values); per_device_train_batch_size is then the batch of the
   whole mesh;
3. evaluation gathers nothing across ranks (they hold the same outputs already);
4. gradients are clipped by their global norm (pm.clip_grad_norm_), not each rank's
   shard's, so every rank scales by the same factor as one device would;
5. weight decay skips the parameters Trainer would skip on the model itself (norms,
   biases), found on the source model and named through pm's shards;
6. columns, labels and the loss's token count come from the source model (its forward
   signature, config and loss_type): where the model takes loss kwargs, Trainer's
   num_items_in_batch goes through the traced program as one more input, so the loss
   is normalised as Trainer normalises it on one device;
7. save_model gathers the full weights on every rank and rank 0 writes them
   (save_pretrained for a PreTrainedModel, else model.safetensors);
8. each training log adds autopar's metrics (runtime/metrics.py) over the steps since
   the previous log: autopar_step_s (mean seconds a step), autopar_tokens_per_s_per_device,
   autopar_mfu and autopar_peak_memory_mib. A step is forward to next forward, so a log
   covers the steps before its own, from the second step on (an evaluation between two
   logs adds its forward calls as steps).

Refused with a TrainerError that names the fix (REFUSED below): a pipelined plan,
checkpoints during training (the optimiser state is each rank's shards), fp16/bf16
autocast, torch_compile, gradient_checkpointing, DataParallel, and a model on another
device than args.device.

Private names of transformers and accelerate this relies on (transformers 5.24,
accelerate 1.16), all here: Trainer._set_signature_columns_if_needed, _clip_grad_norm,
_get_grad_norm and _move_model_to_device (overridden); a model's
_is_accelerate_prepared; BatchSamplerShard's num_processes and process_index (which
Trainer itself resets for its BatchRebalanceSampler).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.utils import can_return_loss, find_labels

from autopar.core.errors import TrainerError
from autopar.runtime.metrics import StepMetrics, combined
from autopar.runtime.module import ParallelModule

SHARDS_PREFIX = "shards."  # pm.named_parameters() = this + the model's state-dict name
TRAINING_ARGS_NAME = "training_args.bin"  # what Trainer saves its arguments as
MIB = 2**20
# attributes Trainer reads off its model (loss_type: whether a causal LM's label count
# skips each row's first position), copied from the source model onto the ParallelModule
INSPECTED = ("config", "loss_type", "main_input_name")

# TrainingArguments autopar replaces: (field, refused when, the fix)
REFUSED: tuple[tuple[str, Callable[[TrainingArguments], bool], str], ...] = (
    ("save_strategy", lambda a: a.save_strategy != "no",
     "its checkpoints would hold rank 0's optimiser shards only; pass save_strategy='no', call "
     "trainer.save_model(dir) for the full weights, and autopar.save_training_checkpoint for a resumable state"),
    ("fp16/bf16", lambda a: a.fp16 or a.bf16,
     "autopar runs the precision it was compiled with: autopar.compile(..., param_dtype=torch.bfloat16)"),
    ("torch_compile", lambda a: a.torch_compile, "compile the rank programs with autopar.compile(..., compile=True)"),
    ("gradient_checkpointing", lambda a: a.gradient_checkpointing,
     "autopar recomputes blocks itself where its memory budget needs it (Options.memory_budget_bytes)"),
    ("n_gpu", lambda a: a.n_gpu > 1, "launch one process per device with torchrun instead of DataParallel"),
)


class AutoparTrainer(Trainer):
    """transformers.Trainer over `model`, a ParallelModule (autopar.compile's), every
    rank running the same loop on the same batches (module docstring)."""

    def __init__(self, model: Optional[ParallelModule] = None, args: Optional[TrainingArguments] = None,
                 **kwargs: Any) -> None:
        check_model(model)
        if args is not None:  # before Trainer acts on them
            check_args(args)
        model._is_accelerate_prepared = True  # 1. accelerate returns it as is
        source = model.source_model
        for name in INSPECTED:  # 6. what Trainer reads off the model, read off the source model
            if hasattr(source, name):
                setattr(model, name, getattr(source, name))
        super().__init__(model=model, args=args, **kwargs)
        check_args(self.args)  # Trainer's default arguments where none were given
        self.model_accepts_loss_kwargs = accepts_loss_kwargs(source)
        if self.args.label_names is None:
            self.label_names = find_labels(type(source))
        self.can_return_loss = can_return_loss(type(source))
        self._window: list[StepMetrics] = []  # 8. the steps since the last log
        self._seen: Optional[StepMetrics] = None

    # ---- 1. placement, 2. data, 3. evaluation ---------------------------------------
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not _same_device(model.device, torch.device(device)):
            raise TrainerError(f"the ParallelModule runs on {model.device} but args.device is {device}: build the "
                               f"model on {device} before autopar.compile (one device per rank under torchrun)")

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.gather_function = _same_on_every_rank

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        return whole_batches(super().get_train_dataloader(), self.args)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        return whole_batches(super().get_eval_dataloader(eval_dataset), self.args)

    def get_test_dataloader(self, test_dataset: Any) -> torch.utils.data.DataLoader:
        return whole_batches(super().get_test_dataloader(test_dataset), self.args)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Not times the ranks: they all train on the same batch."""
        return super().get_total_train_batch_size(args) // max(args.world_size, 1)

    # ---- 4. clipping, 5. weight decay, 6. the model's signature ---------------------
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # max_grad_norm <= 0: the norm only, for the log
            grad_norm = self.model.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        if model is not self.model:
            return super().get_decay_parameter_names(model)
        decayed = set(super().get_decay_parameter_names(self.model.source_model))
        return [name for name, _ in self.model.named_parameters() if name.removeprefix(SHARDS_PREFIX) in decayed]

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            params = inspect.signature(self.model.source_model.forward).parameters
            self._signature_columns = list(params) + sorted({"label", "label_ids", *self.label_names})

    # ---- 7. saving, 8. metrics ------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The full weights, gathered on every rank (call it on all of them), written by
        rank 0 with the processing class and the training arguments."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        full = self.model.full_state_dict()
        if self.args.should_save:
            write_full_weights(self.model.source_model, full, output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        last = self.model.last_step  # the step that ended as this one's forward began
        if last is not None and last is not self._seen:
            self._window.append(last)
            self._seen = last
        return loss

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs and self._window:  # a training log, not evaluation's
            logs.update(step_logs(combined(self._window), len(self._window)))
            self._window = []
        super().log(logs, start_time)


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether Trainer passes num_items_in_batch to `model` (its own rule)."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_model(model: Any) -> None:
    if not isinstance(model, ParallelModule):
        raise TrainerError(f"AutoparTrainer trains a ParallelModule, got {type(model).__name__}: pass "
                           "model=autopar.compile(model, mesh=...) (or use transformers.Trainer for a plain model)")
    if model.stages is not None:
        raise TrainerError("AutoparTrainer runs plans of one program; this plan is pipelined, whose microbatches run "
                           "through torch's schedule: train it with pm.step(*args, target=...) in your own loop")
    if model.options.sharded_outputs:
        raise TrainerError("AutoparTrainer hands Trainer whole outputs (its evaluation concatenates logits); this "
                           "module returns them split, as DTensors (sharded_outputs=True): compile it without")


def check_args(args: TrainingArguments) -> None:
    for field, refused, fix in REFUSED:
        if refused(args):
            raise TrainerError(f"TrainingArguments.{field} is not supported by AutoparTrainer: {fix}")


def whole_batches(loader: torch.utils.data.DataLoader, args: TrainingArguments) -> torch.utils.data.DataLoader:
    """`loader` giving this rank every batch (2. in the module docstring)."""
    if args.world_size <= 1:  # accelerate split nothing
        return loader
    shard = getattr(loader, "batch_sampler", None)
    if hasattr(shard, "num_processes") and hasattr(shard, "process_index"):
        shard.num_processes, shard.process_index = 1, 0
        return loader
    raise TrainerError(f"accelerate split this {type(loader).__name__} over the {args.world_size} processes in a "
                       "way AutoparTrainer does not undo (an IterableDataset?): use a dataset with __len__, so every "
                       "rank can draw every batch")


def write_full_weights(source: nn.Module, full: dict[str, torch.Tensor], output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    if isinstance(source, PreTrainedModel):
        source.save_pretrained(output_dir, state_dict=full)
        return
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(output_dir, "model.safetensors"),
              metadata={"format": "pt"})


def step_logs(m: StepMetrics, steps: int) -> dict[str, float]:
    """The Trainer log entries of `steps` steps combined into `m`."""
    return {"autopar_step_s": m.seconds / steps, "autopar_tokens_per_s_per_device": m.tokens_per_s_per_device,
            "autopar_mfu": m.mfu, "autopar_peak_memory_mib": m.peak_memory_bytes / MIB}


def _same_on_every_rank(tensors: Any, *args: Any, **kwargs: Any) -> Any:
    """Evaluation's gather: every rank holds the whole outputs already."""
    return tensors


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
