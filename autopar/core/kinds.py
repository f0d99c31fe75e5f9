"""The kinds of things a plan talks about, as enums rather than strings to parse.

They are `str` enums (TextEnum, also the base of the options' modes and the pipeline
schedule): their values are what plan files store, and `StepKind("all_gather")` is how a
file's text comes back. They hash like their values (an Enum hashes its member name
otherwise), so a member and its text are one dictionary key, as they are equal.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any

from autopar.core.errors import OptionsError


class TextEnum(str, Enum):
    """A `str` enum shown and hashed as its value (the base of every mode and kind)."""

    def __str__(self) -> str:
        return self.value

    # the member is a str holding its value: str's own hash is the value's, without the
    # Enum.value property lookup (~10^5 hashes per solve)
    __hash__ = str.__hash__

    @classmethod
    def of_option(cls, value: Any, name: str, error: type = OptionsError, extra: str = "") -> Any:
        """The member an option `name` names (a member, or its text); `error` names the
        option and the choices otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise error(f"{name}={value!r} is not one of {[m.value for m in cls]}{extra}; pass one of those "
                        f"(or autopar.{cls.__name__}.<NAME>)") from None


class NodeKind(TextEnum):
    """What a node of the traced graph is. The first four are graph inputs."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"  # a tensor the trace lifted (not in the state dict)
    USER_INPUT = "user_input"  # a tensor leaf of the call's args/kwargs
    GETITEM = "getitem"  # one output of a multi-output op
    OUTPUT = "output"
    OP = "op"  # an ATen operator call

    @property
    def is_input(self) -> bool:
        return self in _INPUTS

    @property
    def is_state(self) -> bool:
        """Parameters and buffers: held by the module, sharded once, fed every step."""
        return self in (NodeKind.PARAMETER, NodeKind.BUFFER)

    @property
    def computes(self) -> bool:
        """Nodes that run an operator (and so cost compute and have strategies to price)."""
        return self is NodeKind.OP


_INPUTS = frozenset({NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT, NodeKind.USER_INPUT})


class StepKind(TextEnum):
    """One move of a reshard step on one mesh axis, forward or backward (autopar/core/resharding.py)."""

    IDENTITY = "identity"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    SLICE = "slice"
    TO_PARTIAL = "to_partial"
    GRAD_SYNC = "grad_sync"

    @property
    def communicates(self) -> bool:
        """Moves bytes between ranks (slice, to_partial, grad_sync's forward and identity do not)."""
        return self in _COMMUNICATING


_COMMUNICATING = frozenset({StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER, StepKind.ALL_GATHER, StepKind.ALL_TO_ALL})


class LossReduction(IntEnum):
    """aten's `reduction` argument of its losses (torch.nn._reduction's numbering); in a
    graph's arguments it is written as the int."""

    NONE = 0
    MEAN = 1
    SUM = 2
