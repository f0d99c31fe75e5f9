"""Repeated blocks (transformer layers) that can share one set of ILP decision variables.

    AnnotatedGraph -> Blocks(block_of: node -> block key, rep: node -> representative node)

A block is the set of nodes whose module path (or, for a parameter, whose state-dict
key) starts with `<container>.<i>`: `transformer.h.3`, `model.layers.17`, `encoder.block.0`.
Two blocks of one container are *twins* when, node by node in topological order, they
have the same op, the same candidate strategies (so the same shapes), inputs from the
same positions inside the block and the same follower groups. Every node of a twin then
maps to its counterpart in the first such block (its representative), and the solver
gives both the same variables. Mode "inner" (the default) also asks twins to share their
context: values entering from and leaving to the same relative places (the neighbouring
block, or one fixed node such as a mask or the final norm), so in a stack of L layers
the first and the last keep their own variables and the L-2 inner ones share one set.
Mode "all" lets the first and last share too: fewer variables, and a plan that can only
lose where an end layer's best choice differs from the inner ones'.

Under mixed precision (Options.param_dtype) the traced model reads copies of its
parameters made by casts at the top of the graph, outside every module; for sharing,
a cast whose one input is a block's parameter belongs to that block (`shared_blocks_of`),
else every layer would read a node of its own from outside and no two would be twins.

Why this is exact where it applies: shared variables force copies to choose alike, and
each copy's compute and the edges into and out of it (the boundaries between blocks
included) are still priced on their own endpoints; an edge whose endpoints map to the
same representative pair has the same cost matrix and the same marginals, so it shares
its flow variables too. What is lost is only the freedom of one layer to differ from
its twins, which tests bound (tests/test_scale.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from autopar.core.kinds import NodeKind
from autopar.core.options import Clustering
from autopar.passes.strategies.strategies import AnnotatedGraph

BLOCK_PATH = re.compile(r"^(.*?)\.?(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Blocks:
    block_of: dict[str, tuple[str, int]]  # node -> (container, index); absent: not in a block
    rep: dict[str, str]  # node -> representative node (itself when not clustered)
    shared_blocks: int  # blocks that reuse another block's variables


def block_key(path: str) -> Optional[tuple[str, int]]:
    m = BLOCK_PATH.match(path)
    return (m.group(1), int(m.group(2))) if m else None


def find_blocks(graph: AnnotatedGraph) -> dict[str, tuple[str, int]]:
    targets = {gi.name: gi.target for gi in graph.traced.inputs}
    block_of = {}
    for n in graph.nodes:
        if n.kind.is_input:
            target = targets.get(n.name)
            path = target if isinstance(target, str) else ""
        else:
            path = n.module
        key = block_key(path) if path else None
        if key is not None:
            block_of[n.name] = key
    return block_of


# ops that only change a tensor's dtype: a parameter's mixed-precision copy (passes/trace/trace.py)
CASTS = frozenset({"aten.to.dtype", "aten._to_copy.default", "prims.convert_element_type.default"})


def shared_blocks_of(graph: AnnotatedGraph) -> dict[str, tuple[str, int]]:
    """find_blocks, with each cast of a block's parameter in that parameter's block (module
    docstring): what clustering compares. Pipelines and recompute keep find_blocks, where a
    block is the ops its module runs."""
    block_of = find_blocks(graph)
    for n in graph.nodes:
        if n.name not in block_of and n.op in CASTS and len(n.inputs) == 1:
            source = graph.node(n.inputs[0][0])
            if source.kind is NodeKind.PARAMETER and source.name in block_of:
                block_of[n.name] = block_of[source.name]
    return block_of


def cluster(graph: AnnotatedGraph, block_of: dict[str, tuple[str, int]], members: dict,
            mode: Clustering = Clustering.INNER) -> Blocks:
    """`members`: node -> ilp.Member built with follower groups kept inside blocks;
    `mode`: Clustering.INNER or ALL (module docstring; OFF finds no blocks to share)."""
    blocks: dict[tuple[str, int], list[str]] = {}
    for n in graph.nodes:
        if n.name in block_of:
            blocks.setdefault(block_of[n.name], []).append(n.name)
    position = {name: i for names in blocks.values() for i, name in enumerate(names)}
    consumers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for u, _ in n.inputs:
            consumers.setdefault(u, []).append(n.name)
    firsts: dict[tuple, list[str]] = {}  # (container, signature) -> first block's nodes
    rep = {n.name: n.name for n in graph.nodes}
    shared = 0
    for key, names in sorted(blocks.items()):
        sig = (key[0], _signature(graph, key, names, block_of, position, members, consumers, mode is not Clustering.ALL))
        first = firsts.setdefault(sig, names)
        if first is names:
            continue
        shared += 1
        for mine, theirs in zip(names, first):
            rep[mine] = theirs
    return Blocks(block_of, rep, shared)


def _context(u: str, block_of: dict, position: dict, key: tuple[str, int]) -> tuple:
    """Where a value entering or leaving the block comes from or goes to, relative to
    the block: a node of the previous or next block (the same for every inner block of
    a stack), or one fixed node (a mask, an embedding, the final norm)."""
    there = block_of.get(u)
    if there is not None and there[0] == key[0]:
        return ("block", there[1] - key[1], position[u])
    return ("node", u)


def _signature(graph: AnnotatedGraph, key: tuple[str, int], names: list[str], block_of: dict, position: dict,
               members: dict, consumers: dict[str, list[str]], with_context: bool) -> tuple:
    local = {name: i for i, name in enumerate(names)}
    out = []
    for name in names:
        n = graph.node(name)
        m = members[name]
        if m.leader not in local:  # a group reaching outside the block: never share
            return ("unique", names[0])
        def context(v: str) -> tuple:
            return _context(v, block_of, position, key) if with_context else ()
        inputs = tuple(("in", local[u], k) if u in local else ("ext", k, context(u)) for u, k in n.inputs)
        leaving = tuple(sorted({context(v) for v in consumers.get(name, ()) if v not in local}))
        out.append((n.op, n.strategies, inputs, leaving, local[m.leader], m.index_map))
    return tuple(out)
