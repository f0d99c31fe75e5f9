"""Symbolic batch and sequence sizes: which input dims one trace and one plan serve.

    Options(dynamic=True)                      batch and sequence dims symbolic, wide ranges
    Options(dynamic=Dynamic(batch=(2, 16),     explicit ranges; the plan is priced at
                            seq=(4, 32),       batch 8, sequence 16 (None: the sizes of the
                            plan_at=(8, 16)))  call that plans)

Which dims: dim 0 of every tensor input is the batch; dim 1 of every integer or bool
tensor input with two dims (token ids, attention masks, labels) is the sequence; a dim
whose size differs from the first input's (position ids of batch 1) stays static. Every
input shares one batch symbol and one sequence symbol (torch.export `Dim`s), so a
call whose inputs disagree on them is another signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from autopar.core.errors import OptionsError

# default ranges of Options(dynamic=True): wide, so that only sizes a model cannot take re-plan
DEFAULT_BATCH = (1, 1 << 16)
DEFAULT_SEQ = (1, 1 << 20)


class OutOfRange(Enum):
    """What a call does whose symbolic size is outside the planned range."""

    REPLAN = "replan"  # warn once, trace and plan again for a range that holds the size
    RAISE = "raise"  # InputMismatchError naming the dim, the size and the range


class DimName(Enum):
    BATCH = "batch"
    SEQ = "seq"


@dataclass(frozen=True)
class Dynamic:
    # (min, max) of the batch dim, inclusive; None keeps the batch static
    batch: Optional[tuple[int, int]] = DEFAULT_BATCH
    # (min, max) of the sequence dim, inclusive; None keeps the sequence static
    seq: Optional[tuple[int, int]] = DEFAULT_SEQ
    # (batch, seq) the cost model prices the plan at; None: the sizes of the call that plans.
    # Rules treat size-1 dims as broadcastable, so price at sizes of 2 or more
    plan_at: Optional[tuple[Optional[int], Optional[int]]] = None
    # a call outside the ranges re-plans (with one warning) or raises
    out_of_range: OutOfRange = OutOfRange.REPLAN

    def __post_init__(self) -> None:
        for name in ("batch", "seq"):
            r = getattr(self, name)
            if r is not None and not (len(r) == 2 and all(isinstance(v, int) for v in r) and 1 <= r[0] <= r[1]):
                raise OptionsError(f"Dynamic.{name}={r!r} is not a range: give (min, max) with 1 <= min <= max, "
                                   f"or None to keep the {name} size static")
        if not isinstance(self.out_of_range, OutOfRange):
            raise OptionsError(f"Dynamic.out_of_range={self.out_of_range!r}: use OutOfRange.REPLAN or OutOfRange.RAISE")

    def range_of(self, dim: DimName) -> Optional[tuple[int, int]]:
        return self.batch if dim is DimName.BATCH else self.seq

    def representative(self, dim: DimName) -> Optional[int]:
        if self.plan_at is None:
            return None
        return self.plan_at[0] if dim is DimName.BATCH else self.plan_at[1]

    @staticmethod
    def of(value: "bool | Dynamic | None") -> Optional["Dynamic"]:
        """Options.dynamic as a Dynamic, or None when shapes are static."""
        if value is None or value is False:
            return None
        if value is True:
            return Dynamic()
        if isinstance(value, Dynamic):
            return value
        raise OptionsError(f"Options.dynamic={value!r}: use True, False or autopar.Dynamic(batch=(lo, hi), "
                           "seq=(lo, hi))")
