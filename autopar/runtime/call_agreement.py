"""Every call's inputs agreed between the ranks before any collective of the step.

    each rank: signature of this call -> 8-byte hash --all-gather--> all equal: run
                                                                 `-> else: all-gather the
                                     signatures' descriptions, InputMismatchError everywhere

Ranks that pass different shapes at some call would otherwise run different programs
(or one would trace and plan a new signature while the others run a cached one) and
wait in each other's collectives until the group's timeout. The first call's
signature is compared in full by the trace shipping (runtime/shipping.py); a later one
only here. The common case costs one all-gather of one int64 per call; the mismatch
case a second, of the descriptions, so that every rank names every rank's inputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.core.errors import InputMismatchError

UNEVEN_BATCH_HINT = ("every rank must pass inputs of the same shapes, non-tensor values and mode at every call: "
                     "for the uneven last batch of a data loader pass drop_last=True, pad that batch to the full "
                     "size on every rank, or compile with Options(dynamic=True) so that one plan serves every size")


@dataclass(frozen=True)
class CallSignature:
    """What must be the same on every rank at one call: its inputs (structure, tensor
    paths, shapes, dtypes and non-tensor values, as runtime/shipping.Inputs compares
    them, or for local inputs the program chosen), train/eval mode and grad mode."""

    inputs: Any
    training: bool
    grad: bool

    def digest(self) -> int:
        raw = hashlib.sha256(repr(self).encode()).digest()[:8]
        return int.from_bytes(raw, "little", signed=True)


def agree_on_call(signature: CallSignature, call: int, group: Any = None) -> None:
    """Return when every rank of `group` (a gloo group; None: the world) passes
    `signature` at its call number `call`; else raise InputMismatchError on every rank,
    naming each rank's."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return
    mine = torch.tensor([signature.digest()], dtype=torch.int64)
    seen = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(seen, mine, group=group)
    if all(int(t) == int(mine) for t in seen):
        return
    described: list = [None] * world
    dist.all_gather_object(described, describe(signature), group=group)
    lines = [f"rank {r}: {d}" for r, d in enumerate(described)]
    raise InputMismatchError(f"the ranks passed different inputs at call {call} "
                             f"(this is rank {dist.get_rank(group)}):\n  " + "\n  ".join(lines)
                             + f"\n{UNEVEN_BATCH_HINT}")


def describe(signature: CallSignature) -> str:
    """One rank's side of a mismatch: its tensors' paths, shapes and dtypes, the rest."""
    inputs = signature.inputs
    tensors = getattr(inputs, "tensors", None)
    text = (", ".join(f"{path} {list(shape)} {str(dtype).replace('torch.', '')}" for path, shape, dtype in tensors)
            if tensors is not None else str(inputs))
    constants = getattr(inputs, "constants", ())
    if constants:
        text += f"; non-tensor inputs {list(constants)}"
    mode = "train" if signature.training else "eval"
    return f"{text}; {mode} mode, grad {'on' if signature.grad else 'off'}"
