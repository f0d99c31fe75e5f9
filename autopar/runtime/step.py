"""One training step for every plan: what ParallelModule.step runs.

A plan of one program runs forward, the loss and backward on this rank; a pipelined
plan's stages (autopar/runtime/stages.py, behind the Stages interface) run every
microbatch under torch's schedule. The loss function sees the model's output the same
way in both: as torch's pipeline() hands it to the last stage, its tensor leaves (the
one tensor when there is only one, such as a ModelOutput's logits), so user code need
not know whether the planner chose a pipeline.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from autopar import _compat
from autopar.core.options import OptionsError
from autopar.core.plan import Plan
from autopar.runtime.checkpoint_view import CheckpointView
from autopar.runtime.outputs import is_split


class Stages(Protocol):
    """A pipelined plan's stages on this rank (autopar/runtime/stages.PipelineStages)."""

    plan: Plan
    solve_count: int

    def modules(self) -> list[Any]: ...  # each stage's ParallelModule, in stage order
    def step(self, *args: Any, target: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]: ...
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None: ...
    def checkpoint_view(self) -> CheckpointView: ...


def loss_input(out: Any) -> Any:
    """The model's output as pipeline()'s last stage gives it to loss_fn: its tensor leaves
    (a ModelOutput's logits alone when it has only those)."""
    leaves = [x for x in _compat.tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def one_program_step(run: Callable[..., Any], loss_fn: Callable[..., torch.Tensor], args: tuple, kwargs: dict,
                     target: Optional[torch.Tensor]) -> torch.Tensor:
    """Forward through `run`, the loss, backward; the loss, detached."""
    out = run(*args, **kwargs)
    if any(is_split(x) for x in _compat.tree_flatten(out)[0]):
        raise OptionsError("pm.step(..., target=...) hands loss_fn the outputs as tensors, but this plan returns "
                           "some split, as DTensors (sharded_outputs=True): compute the loss from pm(...)'s outputs "
                           "yourself, or plan without sharded_outputs")
    loss = loss_fn(loss_input(out), target)
    loss.backward()
    return loss.detach()
