"""Every call's inputs agreed between the ranks before any collective of the step.

    each rank: signature of this call -> 8-byte hash --all-gather--> all equal: run
                                                                 `-> else: all-gather the
                                     signatures' descriptions, InputMismatchError everywhere

Ranks that pass different shapes at some call would otherwise run different programs
(or one would trace and plan a new signature while the others run a cached one) and
wait in each other's collectives until the group's timeout. The first call's
signature is compared in full by the trace shipping (runtime/shipping.py); a later one
only here. The common case costs one all-gather of one int64 per call; the mismatch
case a second, of the descriptions, so that every rank names every rank's inputs. Where
the rank already holds the call's program, the all-gather is only launched before the
program runs and settled before its first collective (PendingAgreement).
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
    PendingAgreement(signature, call, group).settle()


class PendingAgreement:
    """A call's agreement in flight: its all-gather launched, its answer read by `settle`.
    A rank that already holds the call's program launches it, runs the program's local
    work, and settles before the program's first collective (ProcessGroupRunner's gate):
    the gather then travels while the rank computes instead of adding one more meeting of
    all ranks to the step. Ranks that disagree still meet nowhere but here: no rank
    launches another collective before it has settled."""

    def __init__(self, signature: CallSignature, call: int, group: Any) -> None:
        self.signature, self.call, self.group = signature, call, group
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.mine = torch.tensor([signature.digest()], dtype=torch.int64)
        self.seen = [torch.empty_like(self.mine) for _ in range(world)]
        self.work = dist.all_gather(self.seen, self.mine, group=group, async_op=True) if world > 1 else None

    def settle(self) -> None:
        """Wait for the gather (once) and raise InputMismatchError on every rank if any
        rank's signature differs."""
        if self.work is None:
            return
        work, self.work = self.work, None
        work.wait()
        if all(int(t) == int(self.mine) for t in self.seen):
            return
        world = len(self.seen)
        described: list = [None] * world
        dist.all_gather_object(described, describe(self.signature), group=self.group)
        lines = [f"rank {r}: {d}" for r, d in enumerate(described)]
        raise InputMismatchError(f"the ranks passed different inputs at call {self.call} "
                                 f"(this is rank {dist.get_rank(self.group)}):\n  " + "\n  ".join(lines)
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
