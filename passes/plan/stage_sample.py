"""The stage modules a pipelined plan's stages are planned from, split from a short model.

    model of L alike blocks + the plan's stage boundaries
        --each stage's alike blocks cut to its first three and its last, each under its own index--> short model
        --torch's pipeline() split at the same boundaries (pipeline_stages.split_stages)--> short stage modules
    a short stage module's trace
        --its third block copied into the indices up to its last (passes/trace/stretch.py)--> the stage's graph

torch's pipeline() exports the whole model to split it (the 70B shape's 80 blocks: about
30 s, the 405B shape's 126: about 50 s), and each stage module's trace grows with its
blocks again. But a stage of alike blocks traces to its first three blocks, copies of the
third and its last one, as a whole model does (stretched_trace), and what the stages pass
each other does not depend on how many blocks each holds. So the planner splits a model
that keeps SAMPLE alike blocks per stage and stretches each stage's trace to the stage it
stands for. The kept blocks keep their indices ("model.layers.39"), so the short split's
parameter names, module paths and split points are the whole model's and each stretched
graph is the trace of the whole model's stage module: tests check that they are equal, and
the runtime, which splits the whole model to run it, checks each stage plan's fingerprint
against its own trace.

Where the blocks are not alike, no stage has more than SAMPLE of them, the short model does
not split, or a stage's trace does not stretch (NotStretched), the stages are planned from
the whole model's split.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from torch import nn

from autopar.core.pipeline import PipelinePlan
from autopar.passes.trace.stretch import SAMPLE, BlockSpan, alike_blocks, replaced, stretched_span
from autopar.passes.trace.trace import TracedGraph


class NotStretched(Exception):
    """A short stage's trace that does not stand for its stage: plan from the whole split."""


class KeptBlocks(nn.ModuleList):
    """Some of a ModuleList's blocks, each under its own index ("0", "1", "2", "19", "20"):
    state-dict names and module paths stay the whole model's, while indexing, slicing and
    iterating go by position, as over a list of the kept blocks."""

    @classmethod
    def of(cls, blocks: "OrderedDict[str, nn.Module]") -> "KeptBlocks":
        kept = cls()
        kept._modules.update(blocks)
        return kept

    def _get_abs_string_index(self, idx: int) -> str:
        return list(self._modules)[operator.index(idx)]

    def __getitem__(self, idx: "int | slice") -> nn.Module:
        if isinstance(idx, slice):  # the kept blocks in that range, under their own indices
            return KeptBlocks.of(OrderedDict(list(self._modules.items())[idx]))
        return self._modules[self._get_abs_string_index(idx)]

    def _fixed(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a short model's blocks are fixed while it is split (passes/plan/stage_sample.py)")

    append = extend = insert = pop = __delitem__ = __iadd__ = _fixed


@dataclass(frozen=True)
class StageSample:
    """Which blocks of `container` the short model keeps, and per stage the span its trace
    stretches to (None: the stage keeps all its blocks and its trace is its graph)."""

    container: str
    kept: tuple[int, ...]
    spans: tuple[Optional[BlockSpan], ...]


def stage_sample(model: nn.Module, pipeline: PipelinePlan) -> Optional[StageSample]:
    """The short model for `pipeline`'s stages: in each stage, the blocks before the model's
    first alike one and, where it has more than SAMPLE alike blocks, the first three of
    those and its last; None where the container's blocks are not alike from some block on
    or no stage has more than SAMPLE of them (nothing to stretch)."""
    sample = alike_blocks(model, after_unlike=True)
    if sample is None or sample.container != pipeline.container or sample.blocks != pipeline.blocks:
        return None
    if type(model.get_submodule(sample.container)) not in (nn.ModuleList, nn.Sequential):
        return None  # a subclass's own forward or attributes: short_model would not keep them
    kept: list[int] = []
    spans: list[Optional[BlockSpan]] = []
    for stage in pipeline.stages:
        alike = max(stage.first, sample.first)
        if stage.stop - alike <= SAMPLE:
            kept += stage.blocks
            spans.append(None)
            continue
        traced = (alike, alike + 1, alike + 2, stage.stop - 1)
        kept += [*range(stage.first, alike), *traced]
        spans.append(BlockSpan(pipeline.container, traced, stage.stop - 1))
    if all(span is None for span in spans):
        return None
    return StageSample(pipeline.container, tuple(kept), tuple(spans))


@contextmanager
def short_model(model: nn.Module, sample: StageSample) -> Iterator[None]:
    """The model with its block container holding only sample.kept, under their own
    indices, for the duration."""
    def kept(whole: nn.Module) -> nn.Module:
        blocks = OrderedDict((str(index), whole[index]) for index in sample.kept)
        return nn.Sequential(blocks) if isinstance(whole, nn.Sequential) else KeptBlocks.of(blocks)
    with replaced(model, sample.container, kept):
        yield


def stage_graph(traced: TracedGraph, span: Optional[BlockSpan], stage: int) -> TracedGraph:
    """A short stage module's trace stretched to its stage (`span`; None: as it is); a
    NotStretched where it does not stretch."""
    if span is None:
        return traced
    whole = stretched_span(traced, span)
    if whole is None:
        raise NotStretched(f"stage {stage}'s blocks {span.traced} do not stretch to {span.last + 1 - span.traced[0]}")
    return whole
