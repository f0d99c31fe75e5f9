"""The stage split priced on a sample of the model's blocks, where its blocks are alike.

    model with L alike blocks --container cut to its first SAMPLE blocks (put back after)-->
    traced graph of the sample --sub-mesh plan (passes/plan/pipeline.py)--> Units of SAMPLE
    blocks --stretched--> Units of L blocks (first block, inner block x (L - 2), last block)

The stage DP needs each block's price and bytes, and a model of L twin blocks has three
kinds of block: the first (it reads what the embeddings make), the inner ones, the last
(the final norm and head read it). Tracing and solving the whole microbatch graph for
them costs as much as the model is deep (the 405B shape: 19 s of torch.export and a
5 s solve for 126 blocks); a sample of SAMPLE blocks costs a few seconds whatever L.

Blocks are alike (passes/trace/stretch.py alike_blocks, which also cuts the container
and builds whole graphs from such a sample) when every one is of one class with the same
parameter and buffer names, shapes and dtypes, and the same plain attributes in each
submodule, but for integers that count the block's place (transformers' layer_idx). Here
the sample starts at the first block. The sample's own inner blocks are
compared too (stretched): where their prices differ the sample says nothing for the
blocks it left out, and the caller traces the whole graph instead. Only the split is
priced so: every stage's own plan is solved on its own traced graph afterwards.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
import math
from typing import Any, Optional

import torch
from torch import nn

from autopar.core.errors import TraceError
from autopar.passes.plan.pipeline_split import Units
from autopar.passes.plan.planning import trace_for_planning
from autopar.passes.trace.stretch import SAMPLE, BlockSample, alike_blocks, cut
from autopar.passes.trace.trace import TracedGraph


class UnlikeSample(Exception):
    """The sample's inner blocks are priced differently: it does not stand for the model's
    blocks (plan_model traces the whole graph instead)."""


def stretched(units: Units, sample: BlockSample) -> Optional[Units]:
    """The Units of all `sample.blocks` blocks from those of the sample (module docstring),
    or None where they are not the sample's container's or its two inner blocks differ."""
    if units.container != sample.container or len(units.block_s) != SAMPLE:
        return None
    inner = (units.block_s, units.param_bytes, units.state_bytes, units.activation_bytes)
    if any(len(v) and not _same(v[1], v[2]) for v in inner):
        return None
    n = sample.blocks

    def blocks(values: tuple) -> tuple:
        return (values[0],) + (values[1],) * (n - 2) + (values[-1],) if values else values
    bounds = units.boundary_bytes
    return replace(units, block_s=blocks(units.block_s), param_bytes=blocks(units.param_bytes),
                   state_bytes=blocks(units.state_bytes), activation_bytes=blocks(units.activation_bytes),
                   boundary_bytes=(bounds[0],) + (bounds[1],) * (n - 3) + (bounds[2],))


def _same(a: Any, b: Any) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) if isinstance(a, float) else a == b


def priced_trace(model: nn.Module, micro_args: tuple, micro_kwargs: dict, param_dtype: Optional[torch.dtype],
                 sample: Optional[BlockSample] = None) -> TracedGraph:
    """The graph the stage split is priced on: one microbatch through the model, with its
    block container cut to the sample's blocks where `sample` is given (block_sample.py)."""
    with cut(model, sample) if sample else nullcontext():
        return trace_for_planning(model, micro_args, micro_kwargs, param_dtype)


def sampled_trace(model: nn.Module, micro_args: tuple, micro_kwargs: dict, param_dtype: Optional[torch.dtype],
                  sample: Optional[BlockSample]) -> tuple[TracedGraph, Optional[BlockSample]]:
    """(priced_trace with `sample`, sample), or of the whole graph and None where the model
    cut to the sample does not trace (a forward that needs all its blocks)."""
    if sample is not None:
        try:
            return priced_trace(model, micro_args, micro_kwargs, param_dtype, sample), sample
        except TraceError:
            pass
    return priced_trace(model, micro_args, micro_kwargs, param_dtype), None
