"""Per-rank memory of a node under a strategy, in bytes.

    parameter    local shard; in training also its gradient and the optimiser state
                 (AdamW: two fp32 values per element, Options.optimizer_state_bytes)
    buffer       local shard
    user input   local block
    op           its local outputs (views excepted); in training the saved activations:
                 only the outputs autograd keeps for backward where `saved` says which
                 (passes/trace/saved.py), else all of them (an upper bound); in inference an
                 upper bound of what is live at once
    output       in training, what the program returns to the caller, in the layout it is
                 returned in (whole on every rank unless the plan leaves it split): live at
                 the end of forward, kept or not for backward (a logits tensor gathered for
                 the caller is a copy of its own beside the block the op made). `saved`
                 marks the inputs returned (False: a buffer's new value, stored in the
                 buffer). Counted again where backward also keeps the same tensor (an upper
                 bound); in inference 0, the op outputs being counted already
"""

from __future__ import annotations

from math import prod
from typing import Any, Optional, Sequence

from autopar.core.kinds import NodeKind
from autopar.core.placement import Spec
from autopar.cost_models.compute import VIEWS


def node_bytes(kind: NodeKind, target: Optional[Any], outputs: tuple[Spec, ...], mesh_shape: tuple[int, ...],
               training: bool, optimizer_state_bytes: int, saved: Sequence[bool] = (),
               inputs: tuple[Spec, ...] = ()) -> int:
    """`saved`: per output, whether backward keeps it (training only; empty: all);
    `inputs`: the node's input layouts (read for the output node: what it returns)."""
    if kind is NodeKind.OUTPUT:
        if not training:
            return 0
        returned = saved or (True,) * len(inputs)
        return sum(s.local_nbytes(mesh_shape) for s, kept in zip(inputs, returned) if kept)
    if kind is NodeKind.PARAMETER:
        spec = outputs[0]
        local = spec.local_nbytes(mesh_shape)
        if training and spec.meta.dtype.is_floating_point:
            local += local + prod(spec.local_shape(mesh_shape)) * optimizer_state_bytes
        return local
    if kind.is_input:
        return outputs[0].local_nbytes(mesh_shape)
    if target is None or target in VIEWS:
        return 0
    if training and saved:
        return sum(s.local_nbytes(mesh_shape) for s, kept in zip(outputs, saved) if kept)
    return sum(s.local_nbytes(mesh_shape) for s in outputs)
