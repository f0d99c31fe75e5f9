"""The stage split priced on a sample of the model's blocks, where its blocks are alike.

    model with L alike blocks --container cut to its first SAMPLE blocks (put back after)-->
    traced graph of the sample --sub-mesh plan (passes/plan/pipeline.py)--> Units of SAMPLE
    blocks --stretched--> Units of L blocks (first block, inner block x (L - 2), last block)

The stage DP needs each block's price and bytes, and a model of L twin blocks has three
kinds of block: the first (it reads what the embeddings make), the inner ones, the last
(the final norm and head read it). Tracing and solving the whole microbatch graph for
them costs as much as the model is deep (the 405B shape: 19 s of torch.export and a
5 s solve for 126 blocks); a sample of SAMPLE blocks costs a few seconds whatever L.

Blocks are alike when every one is of one class with the same parameter and buffer names,
shapes and dtypes, and the same plain attributes in each submodule, but for integers that
count the block's place (transformers' layer_idx). The sample's own inner blocks are
compared too (stretched): where their prices differ the sample says nothing for the
blocks it left out, and the caller traces the whole graph instead. Only the split is
priced so: every stage's own plan is solved on its own traced graph afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
import math
from typing import Any, Iterator, Optional

import torch
from torch import nn

from autopar.core.errors import TraceError
from autopar.passes.plan.pipeline_split import Units
from autopar.passes.plan.planning import trace_for_planning
from autopar.passes.trace.trace import TracedGraph

SAMPLE = 4  # first, two inner (compared with each other), last
PLAIN_TYPES = (bool, int, float, str, tuple, type(None))


@dataclass(frozen=True)
class BlockSample:
    """Where the model's blocks live and how many there are (what stretched restores)."""

    container: str  # module path of the ModuleList, as the traced graph names it ("model.layers")
    blocks: int


class UnlikeSample(Exception):
    """The sample's inner blocks are priced differently: it does not stand for the model's
    blocks (plan_model traces the whole graph instead)."""


def alike_blocks(model: nn.Module) -> Optional[BlockSample]:
    """The model's block container (of the ModuleLists and Sequentials outside any block,
    as passes/strategies/clusters.py finds blocks, the one with the most children) when
    it has more than SAMPLE blocks and they are alike (module docstring); else None."""
    lists = [(len(m), path) for path, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and path and len(m) > SAMPLE
             and not any(part.isdigit() for part in path.split("."))]  # not inside a block (experts)
    if not lists:
        return None
    _, path = min(lists, key=lambda x: (-x[0], x[1]))
    blocks = list(model.get_submodule(path))
    first = _signature(blocks[0])
    if not all(_alike(first, _signature(b), place) for place, b in enumerate(blocks[1:], start=1)):
        return None
    return BlockSample(path, len(blocks))


def _signature(block: nn.Module) -> tuple:
    """What makes blocks alike: state names, shapes and dtypes; each submodule's class and
    plain attributes."""
    tensors = [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]
    state = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)
    attributes = tuple((name, type(sub).__qualname__,
                        tuple(sorted((k, v) for k, v in vars(sub).items()
                                     if not k.startswith("_") and isinstance(v, PLAIN_TYPES))))
                       for name, sub in block.named_modules(remove_duplicate=False))
    return state, attributes


def _alike(first: tuple, other: tuple, place: int) -> bool:
    """Signatures equal, but for integers that count the block's place: 0 in the first
    block, `place` in the other (transformers' layer_idx)."""
    if first[0] != other[0] or len(first[1]) != len(other[1]):
        return False
    for (name, kind, plain), (name2, kind2, plain2) in zip(first[1], other[1]):
        if (name, kind, len(plain)) != (name2, kind2, len(plain2)):
            return False
        for (k, v), (k2, v2) in zip(plain, plain2):
            counts = type(v) is int and type(v2) is int and (v, v2) == (0, place)
            if k != k2 or (v != v2 and not counts):
                return False
    return True


@contextmanager
def cut(model: nn.Module, sample: BlockSample) -> Iterator[None]:
    """The model with its block container holding its first SAMPLE blocks, for the duration."""
    parent_path, _, name = sample.container.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    whole = getattr(parent, name)
    short = type(whole)(*list(whole)[:SAMPLE]) if isinstance(whole, nn.Sequential) else \
        nn.ModuleList(list(whole)[:SAMPLE])
    parent._modules[name] = short
    try:
        yield
    finally:
        parent._modules[name] = whole


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
