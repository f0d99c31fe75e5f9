"""Outputs left split (Options.sharded_outputs): the output node takes each output in
any layout the solver prefers, instead of asking every one whole on every rank.

A causal LM's logits are its largest tensor; gathered for the caller they are a whole
copy per rank and the biggest collective of a long-sequence step. Left split, the caller
gets them as a DTensor (autopar/runtime/outputs.py) and gathers what it needs, if
anything.

    allowed per output   every even R/S(d) layout (strategies.layouts): no partial sums,
                         which a caller cannot read, and no whole-head blocks S(d/u),
                         which a DTensor cannot describe
    buffer updates       the layout the output node already asks (buffer_layouts.py)
    the node's choices   the product over outputs; past MAX_CHOICES the smallest outputs
                         are asked whole (largest first keep their freedom), so a model
                         returning many hidden states still plans

The edge prices decide the rest: an output whose producer is split costs nothing to
return split, and the memory model counts each output in the layout it is returned in
(cost_models/memory.py)."""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from math import prod

from autopar.core.placement import Spec
from autopar.passes.rules import Strategy
from autopar.passes.strategies.strategies import OUTPUT, AnnotatedGraph, layouts

MAX_CHOICES = 512


def outputs_left_split(graph: AnnotatedGraph) -> AnnotatedGraph:
    """`graph` with its output node offering every allowed layout of each output."""
    output = graph.by_name.get(OUTPUT)
    if output is None or len(output.strategies) != 1:
        return graph
    asked = output.strategies[0].inputs
    updated = graph.traced.updated_positions
    options = [[spec] if i in updated else layouts(spec.meta, graph.mesh) for i, spec in enumerate(asked)]
    by_size = sorted(range(len(asked)), key=lambda i: (_nbytes(asked[i]), -i))
    for i in by_size:  # the smallest outputs give up their freedom first
        if prod(len(o) for o in options) <= MAX_CHOICES:
            break
        options[i] = [asked[i]]
    strategies = tuple(Strategy(tuple(specs), ()) for specs in product(*options))
    new = replace(output, strategies=strategies)
    nodes = tuple(new if n is output else n for n in graph.nodes)
    return replace(graph, nodes=nodes, by_name={**graph.by_name, new.name: new})


def _nbytes(spec: Spec) -> int:
    try:
        return int(prod(spec.meta.shape)) * spec.meta.dtype.itemsize
    except TypeError:  # a symbolic size
        return 0
