"""The local form of each op: what the rank at some mesh coordinates runs for a node,
given the specs its strategy chose. Most ops run as they are on the local blocks; these
do not:

    view, reshape,       argument 1 spells the output's size: it becomes the local
    _unsafe_view, expand block's size (and view becomes reshape: a block can be laid
                         out otherwise than the whole tensor was)
    squeeze()            drops only the dims that are unit dims of the whole tensor (a
                         dim split to one element per rank is a unit dim locally)
    embedding            with a vocabulary-split weight, embedding_block (Megatron's
                         vocab-parallel embedding): rows [start, start + local rows) live
                         here; ids outside look up nothing and give zeros, so the ranks'
                         outputs sum to the full lookup (the rule's output is P)
    causal sdpa          with its query rows split (context parallelism, keys and values
                         whole), causal_rows_attention: the rank's rows see keys up to
                         their own global position, an explicit mask offset by where
                         the block starts (is_causal would align its first row with key
                         0). The start is worked out when the block runs, from the keys'
                         length, so a plan of symbolic sequence length starts each block
                         where that call's chunks do. Rows split on one axis:
                         BalancedCausalRows, which the rewrite makes a module that swaps
                         half the rows with the mirror rank (autopar/core/causal.py)
    routed_experts       with experts split on an axis (autopar/core/routed.py): rows whole
                         there, masked_rows (this rank's experts' rows, from the block's
                         first expert); rows split there too, ExpertParallel(axis), which
                         the rewrite makes a module that exchanges rows over the axis

The rewrite (passes/lower/rewrite.py), the block-by-block runner (passes/rules/blockwise.py), rule discovery and
the runtime's measurements all run ops through localize_call, so a rank, the simulator
and the solver's timings run the same local form.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from autopar.core.causal import BalancedCausalRows, causal_rows_attention, sdpa_is_causal
from autopar.core.placement import block_index, chunk_of
from autopar.core.routed import ROUTED_EXPERTS, ExpertParallel, masked_rows

aten = torch.ops.aten

# ops whose argument 1 is the output size: it must become the local size
SIZE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
# a local block can be laid out otherwise than the whole tensor was (a shard cut along an
# inner dim, a gathered result), so a view that was legal on the whole may not be on the
# block: reshape views where it can and copies where it must. Graphs are functional where
# values are written (passes/trace/trace.py), so no write relies on the aliasing.
LOCAL_TARGET = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


def localize_args(target: Any, args: tuple, outputs: tuple, mesh_shape: tuple[int, ...],
                  coords: Optional[tuple[int, ...]] = None) -> tuple:
    """Arguments that spell the output's global size become the local size: the block of
    the rank at `coords` (an uneven shard's last blocks are short), else the largest."""
    if target in SIZE_ARG_OPS and outputs:
        out = outputs[0]
        shape = out.local_shape(mesh_shape) if coords is None else out.local_shape_at(mesh_shape, coords)
        return (args[0], list(shape)) + tuple(args[2:])
    return args


def localize_call(target: Any, args: tuple, kwargs: dict, inputs: tuple, outputs: tuple,
                  mesh_shape: tuple[int, ...], coords: Optional[tuple[int, ...]], sizes_done: bool = False
                  ) -> tuple[Any, tuple, dict]:
    """The (target, args, kwargs) the rank at `coords` runs for a node under a strategy
    with these input and output specs: shape arguments made local (unless `sizes_done`:
    local_sizes made them so), and ops whose sharded form is another op replaced."""
    if not sizes_done:
        args = localize_args(target, args, outputs, mesh_shape, coords)
    if target is aten.squeeze.default and inputs:
        # squeeze() drops every unit dim, and a dim split to one element per rank is a unit
        # dim locally: drop only the dims that are unit dims of the whole tensor
        return aten.squeeze.dims, (args[0], [d for d, n in enumerate(inputs[0].meta.shape) if n == 1]), kwargs
    if target is aten.embedding.default and inputs and inputs[0].shard_axes(0):
        start = block_index(inputs[0], mesh_shape, _needed(coords, "a vocabulary-split embedding"))[0].start
        return embedding_block, (args[0], args[1], start) + tuple(args[2:]), kwargs
    if target is aten.scaled_dot_product_attention.default and inputs and inputs[0].shard_axes(2) \
            and sdpa_is_causal(args, kwargs):
        chunk = chunk_of(inputs[0], 2, mesh_shape, _needed(coords, "causal attention split along the sequence"))
        axes = inputs[0].shard_axes(2)
        if len(axes) == 1:  # the mirror block is on this axis: balanced (autopar/core/causal.py)
            return BalancedCausalRows(axes[0], *chunk), args, kwargs
        return causal_rows_attention, chunk + tuple(args), kwargs
    if target is ROUTED_EXPERTS and inputs and inputs[-1].shard_axes(0):
        axis = inputs[-1].shard_axes(0)[0]
        if axis in inputs[0].shard_axes(0):
            return ExpertParallel(axis), args, kwargs
        start = block_index(inputs[-1], mesh_shape, _needed(coords, "experts split with rows whole"))[0].start
        return masked_rows, (start,) + tuple(args), kwargs
    return target, args, kwargs


def _needed(coords: Optional[tuple[int, ...]], what: str) -> tuple[int, ...]:
    if coords is None:
        raise ValueError(f"{what} needs the rank's mesh coordinates")
    return coords



def embedding_block(weight: torch.Tensor, indices: torch.Tensor, start: int, padding_idx: int = -1,
                    scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    rows = weight.shape[0]
    local = indices - start
    inside = (local >= 0) & (local < rows)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
    out = aten.embedding.default(weight, local.clamp(0, rows - 1), pad, scale_grad_by_freq, sparse)
    return out * inside.unsqueeze(-1).to(out.dtype)
