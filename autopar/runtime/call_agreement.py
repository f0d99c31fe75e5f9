"""Every call's inputs agreed between the ranks before any collective of the step.

    each rank: signature of this call -> hash h --all-reduce max of (h, -h)--> max = min: run
                                                                          `-> else: all-gather the
                                     signatures' descriptions, InputMismatchError everywhere

Ranks that pass different shapes at some call would otherwise run different programs
(or one would trace and plan a new signature while the others run a cached one) and
wait in each other's collectives until the group's timeout. The first call's
signature is compared in full by the trace shipping (runtime/shipping.py); a later one
only here. The common case costs one all-reduce of two int64 per call: the largest hash
and the negated smallest, equal only where every rank's hash is the same (on 8 gloo ranks
a small all-reduce takes a fraction of what an all-gather does: bench/call_agreement.py).
The mismatch case costs an all-gather of the descriptions, so that every rank names every
rank's inputs.

Where the call's program is already compiled on this rank, the agreement is started
before the program and settled before its first collective (runtime/collectives.py:
settled_before_first_collective): a data-parallel forward, whose first collective is its
loss all-reduce at the end, then waits once instead of twice. Until then the program only
computes: its buffer updates are outputs stored after it returns, so a refused call
changes no state (but for the random-number generator's position). A call that must be
traced and planned first, or whose inputs this rank refused, settles before anything, and
so does a program under torch.compile, whose compiled code launches its collectives
without passing through collectives._ops.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from autopar.core.errors import InputMismatchError
from autopar.runtime.shipping import Inputs

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

    @staticmethod
    def of_call(args: tuple, kwargs: dict, training: bool, refused: Optional[Exception] = None,
                local_program: Optional[str] = None) -> "CallSignature":
        """A call's signature: why this rank refused its inputs, else the fingerprint of the
        program its local inputs feed, else its inputs."""
        if refused is not None:
            inputs: Any = f"inputs refused here ({type(refused).__name__}: {refused})"
        elif local_program is not None:
            inputs = ("local inputs of", local_program)
        else:
            inputs = Inputs.of(args, kwargs)
        return CallSignature(inputs, training, torch.is_grad_enabled())

    def digest(self) -> int:
        """A 62-bit hash, so that it and its negation are int64 values."""
        raw = hashlib.sha256(repr(self).encode()).digest()[:8]
        return int.from_bytes(raw, "little") >> 2


class PendingAgreement:
    """A call's agreement under way: `settle` waits for it and raises where ranks differ."""

    def __init__(self, signature: CallSignature, call: int, group: Any, world: int) -> None:
        self.signature, self.call, self.group, self.world = signature, call, group, world
        digest = signature.digest()
        self.extremes = torch.tensor([digest, -digest], dtype=torch.int64)
        self.work = dist.all_reduce(self.extremes, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def settle(self) -> None:
        """Return when every rank passed the same signature at this call; else raise
        InputMismatchError on every rank, naming each rank's."""
        self.work.wait()
        largest, smallest = int(self.extremes[0]), -int(self.extremes[1])
        if largest == smallest:
            return
        described: list = [None] * self.world
        dist.all_gather_object(described, describe(self.signature), group=self.group)
        lines = [f"rank {r}: {d}" for r, d in enumerate(described)]
        raise InputMismatchError(f"the ranks passed different inputs at call {self.call} "
                                 f"(this is rank {dist.get_rank(self.group)}):\n  " + "\n  ".join(lines)
                                 + f"\n{UNEVEN_BATCH_HINT}")


def start_agreement(signature: CallSignature, call: int, group: Any = None,
                    settle_now: bool = False) -> Optional[PendingAgreement]:
    """Start agreeing on `signature` at call number `call` among the ranks of `group` (a
    gloo group; None: the world); None where the group has one rank or, with settle_now,
    once settled."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return None
    pending = PendingAgreement(signature, call, group, world)
    if settle_now:
        pending.settle()
        return None
    return pending


def agree_on_call(signature: CallSignature, call: int, group: Any = None) -> None:
    """Return when every rank of `group` passes `signature` at its call number `call`;
    else raise InputMismatchError on every rank, naming each rank's."""
    start_agreement(signature, call, group, settle_now=True)


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
