"""The canonical form of a traced graph: node order and names that depend on what the
graph computes, never on the order in which the model's Python built it.

    placeholders (signature order) | ops in the order the model ran them | output
                                   v
    placeholders (signature order) | ops in post-order from the output   | output
                                     named op, op_1, op_2 ... in that order

A model that iterates a set while it builds its graph (transformers' `set(layer_types)`
in Gemma 3, ModernBERT and ~40 more) records its ops in an order that follows
PYTHONHASHSEED, and FX names nodes by creation order (`linear_3` is the fourth linear
made), so the same model traces to differently ordered and named graphs in two
processes, with two fingerprints. The order below is a function of the graph's wiring
alone, so every process reaches the same graph, fingerprint and plan digest.

0. Values nothing reads are dropped, unless computing them has an effect (FX's
   eliminate_dead_code): torch's serialiser adds a getitem for every unused output of
   a multi-output op (batch norm's saved statistics), which a fresh trace does not have.
1. Placeholders keep their order (torch.export's signature: parameters, buffers,
   constants, user inputs, each in state-dict or argument order) and their names.
2. The output's inputs are visited depth first, each node's inputs in argument order,
   and a node is placed once all its inputs are: a topological order fixed by the
   wiring, which also computes each value close to its first use.
3. Nodes the output does not depend on (assertions torch.export keeps for their side
   effect) follow, each once its inputs are placed, ordered by a hash of what it
   computes (op, arguments and, through them, everything upstream) and then by the
   positions of its inputs.
4. Every other node is renamed by its op and its rank among that op's nodes in the new
   order (`linear`, `linear_1`, ...), FX's own scheme.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from typing import Iterable

import torch
from torch import fx

from autopar import _compat

_NUMBERED = re.compile(r"^(.*?)(_\d+)?$")


def canonicalise(graph: fx.Graph) -> None:
    """Reorder and rename `graph` into the canonical form, in place; the caller regenerates
    its module's code (gm.recompile()) once its passes are done."""
    # 0. dead values
    graph.eliminate_dead_code()
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in reversed(nodes) if n.op == "output")
    # 1-3. order
    order = list(placeholders)
    placed = set(order)
    _post_order(output.all_input_nodes, placed, order)
    loose = [n for n in nodes if n not in placed and n is not output]
    if loose:
        _append_loose(loose, _content_digests(nodes), placed, order)
    order.append(output)
    anchor = order[0]
    for node in order[1:]:
        if node.prev is not anchor:
            anchor.append(node)
        anchor = node
    # 4. names
    _compat.rename_nodes(graph, {n: _NUMBERED.match(n.name).group(1) or n.op for n in order
                                 if n.op not in ("placeholder", "output")})


def _post_order(roots: Iterable[fx.Node], placed: set, order: list) -> None:
    """Append to `order` every node `roots` depend on, then the roots, depth first with
    each node's inputs in argument order (iterative: graphs reach 10^5 nodes)."""
    for root in roots:
        if root in placed:
            continue
        stack = [(root, iter(root.all_input_nodes))]
        while stack:
            node, inputs = stack[-1]
            nxt = next((i for i in inputs if i not in placed), None)
            if nxt is not None:
                stack.append((nxt, iter(nxt.all_input_nodes)))
                continue
            stack.pop()
            if node not in placed:
                placed.add(node)
                order.append(node)


def _append_loose(loose: list[fx.Node], digests: dict[fx.Node, str], placed: set, order: list) -> None:
    """Append the nodes the output does not depend on, each once its inputs are placed,
    the ready one with the least (content hash, positions of its inputs) first: two
    nodes that compute the same thing on different values are told apart by where
    those values stand in the canonical order. A node's key is fixed once it is ready
    (its inputs are placed), so the ready ones wait in a heap; equal keys go in their
    graph order."""
    position = {n: i for i, n in enumerate(order)}
    index = {n: k for k, n in enumerate(loose)}
    unplaced = {n: sum(i not in placed for i in n.all_input_nodes) for n in loose}
    ready: list = []

    def push(n: fx.Node) -> None:
        heapq.heappush(ready, (digests[n], tuple(position[i] for i in n.all_input_nodes), index[n]))

    for n in loose:
        if not unplaced[n]:
            push(n)
    while ready:
        node = loose[heapq.heappop(ready)[2]]
        placed.add(node)
        position[node] = len(order)
        order.append(node)
        for user in node.users:
            if user in unplaced and user not in placed:
                unplaced[user] -= 1
                if not unplaced[user]:
                    push(user)


def _content_digests(nodes: list[fx.Node]) -> dict[fx.Node, str]:
    """A hash of what each node computes: its op, its non-node arguments, its value's
    shape and dtype, and its inputs' hashes (placeholders by name), independent of node
    names and order. `nodes` in a topological order."""
    digests: dict[fx.Node, str] = {}
    for n in nodes:
        if n.op == "placeholder":
            digests[n] = n.name
            continue
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{digests[a]}")
        val = n.meta.get("val")
        value = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        text = repr((n.op, str(n.target), args, value))
        digests[n] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return digests
