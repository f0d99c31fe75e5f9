"""Find the routed part of mixture-of-experts layers in a traced graph and make each one
node of autopar/core/routed.py's `routed_experts` op, which the rules can split by
expert (expert parallelism) as well as by rows.

    before                                             after
    ids = view(topk_indices, [-1])                     ids = view(topk_indices, [-1])
    sorted, perm = sort(ids)
    x_g = index(x, [floor_divide(perm, k)])
    w_g = index(weights, [perm])
    offsets = cumsum(histc(sorted.float(), E, 0, E-1))
    h = grouped_mm(x_g, w1, offsets) ... (row-wise ops)
    y = grouped_mm(h, w2, offsets) * w_g[:, None]
    inv = index_put(empty_like(perm), [perm], arange(S))
    out = index(y, [inv])                              out = routed_experts(ids, [x, weights], [w1, w2],
                                                                           [k, 1], E, body)
(transformers' grouped_mm experts: Mixtral, Qwen-MoE, DeepSeek-V3, OLMoE, ...)

1. Each sort of a 1-D integer tensor (ascending) is a candidate; its sorted values may
   only be counted (histc over [0, E-1] with E bins, then cumsum: the offsets).
2. Its permutation may only gather rows (`index(src, [perm])`, `index(src, [perm // g])`)
   and be inverted (`index_put(empty_like(perm), [perm], arange(S))`).
3. The region is what flows from the gathered rows and the offsets up to the one gather
   by the inverse that puts rows back in order (the exit). Its ops must read nothing
   else but expert-indexed tensors (the grouped matmuls' weights, first dim E); every
   value of it has S rows, so each row is computed alone.
4. The region's ops become a body graph (offsets, sorted rows, experts -> rows), the exit
   a routed_experts node; the rest is dead and removed.
A candidate that fails a test stays as it was (its ops keep their own rules) and, in a
graph that counts or multiplies by expert (histc, a grouped matmul), the reason is
recorded for the plan's summary: `routing_notes(gm)`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx

from autopar.core.errors import describe_node
from autopar.core.log import LOG
from autopar.core.routed import ROUTED_EXPERTS, register_body
from autopar.passes.trace.canonical import canonicalise

aten = torch.ops.aten

_SORTS = (aten.sort.default, aten.sort.stable)
_CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout)
_GROUPED_MM = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")
_ASSERTS = (aten._assert_tensor_metadata.default,)
NOTES_KEY = "autopar.routing_notes"  # gm.meta: why a sort by expert was not made a routed_experts node


class NotRouting(Exception):
    """A candidate sort that is not the routing pattern (the reason is the message)."""


@dataclass(frozen=True)
class _Routing:
    ids: fx.Node
    gathers: tuple[tuple[fx.Node, fx.Node, int], ...]  # (gather node, source, row group)
    offsets: fx.Node
    num_experts: int
    region: tuple[fx.Node, ...]  # graph order
    experts: tuple[fx.Node, ...]
    exit: fx.Node
    dead: tuple[fx.Node, ...]  # the sort, count and inverse nodes


def collapse_routed_experts(gm: fx.GraphModule) -> int:
    """Step 4 for every routing found; returns how many were collapsed. The caller
    regenerates gm's code (gm.recompile()) once its passes are done."""
    notes: list[str] = []
    found = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SORTS]:
        try:
            routing = _match(node)
        except NotRouting as e:
            notes.append(f"{describe_node(node)}: {e}")
            LOG.info("routed experts: %s", notes[-1])
            continue
        _collapse(gm, routing)
        found += 1
    if found:
        gm.graph.eliminate_dead_code()  # 4. the replaced ops
        gm.graph.lint()
    moe = any(n.op == "call_function" and (_grouped_mm(n) or n.target is aten.histc.default) for n in gm.graph.nodes)
    gm.meta[NOTES_KEY] = tuple(notes) if moe else ()  # a sort in a model without experts is no routing
    return found


def routing_notes(gm: fx.GraphModule) -> tuple[str, ...]:
    return gm.meta.get(NOTES_KEY, ())


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if u.target not in _ASSERTS]


def _match(sort: fx.Node) -> _Routing:
    ids = sort.args[0]
    v = _val(ids)
    if v is None or v.ndim != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
        raise NotRouting("not a sort of a 1-D integer tensor")
    if bool(sort.kwargs.get("descending", sort.args[2] if len(sort.args) > 2 else False)):
        raise NotRouting("a descending sort")
    outs = {u.args[1]: u for u in sort.users if u.target is operator.getitem}
    if set(outs) != {0, 1} or len(sort.users) != 2:
        raise NotRouting("both the sorted values and the permutation must be read")
    rows = v.shape[0]
    offsets, num_experts, count_nodes = _offsets(outs[0])
    gathers, inverse_nodes, inv = _permutation_uses(outs[1], rows)
    region, experts, exit_ = _region(gathers, offsets, inv, rows, num_experts)
    dead = (sort, outs[0], outs[1]) + count_nodes + inverse_nodes
    return _Routing(ids, gathers, offsets, num_experts, region, experts, exit_, dead)


def _offsets(values: fx.Node) -> tuple[fx.Node, int, tuple[fx.Node, ...]]:
    """1. sorted values -> [casts] -> histc(E bins over [0, E-1]) -> cumsum -> [casts]."""
    chain, node = [], values
    while True:
        users = _users(node)
        if len(users) != 1:
            raise NotRouting(f"the sorted ids are read by {len(users)} ops, not counted once")
        node = users[0]
        chain.append(node)
        if node.target in _CASTS:
            continue
        if node.target is aten.histc.default:
            bins, lo, hi = (list(node.args[1:4]) + [100, 0, 0])[:3]
            if lo != 0 or hi != bins - 1:
                raise NotRouting(f"histc over [{lo}, {hi}] with {bins} bins does not count experts 0..E-1")
            break
        raise NotRouting(f"the sorted ids feed {node.target}, not a histc count")
    cumsum = _users(node)
    if len(cumsum) != 1 or cumsum[0].target is not aten.cumsum.default or cumsum[0].args[1] not in (0, -1):
        raise NotRouting("the expert counts are not summed into offsets by one cumsum")
    chain.append(cumsum[0])
    offsets = cumsum[0]
    while len(_users(offsets)) == 1 and _users(offsets)[0].target in _CASTS:
        offsets = _users(offsets)[0]
        chain.append(offsets)
    return offsets, int(bins), tuple(chain[:-1])


def _permutation_uses(perm: fx.Node, rows: int
                      ) -> tuple[tuple[tuple[fx.Node, fx.Node, int], ...], tuple[fx.Node, ...], fx.Node]:
    """2. Gathers of rows by the permutation, and its inverse (index_put of arange)."""
    gathers: list[tuple[fx.Node, fx.Node, int]] = []
    inverse: list[fx.Node] = []
    inv: Optional[fx.Node] = None
    for u in _users(perm):
        if u.target is aten.floor_divide.default and isinstance(u.args[1], int) and u.args[1] > 0:
            for g in _users(u):
                gathers.append((g, _gathered_source(g, u), u.args[1]))
            inverse.append(u)
        elif u.target is aten.index.Tensor:
            gathers.append((u, _gathered_source(u, perm), 1))
        elif u.target is aten.empty_like.default:
            inverse.append(u)
        elif u.target is aten.index_put.default and _is_inverse(u, perm, rows):
            inverse.extend([u, u.args[2]])
            inv = u
        else:
            raise NotRouting(f"the permutation is read by {u.format_node()}, which neither gathers rows nor "
                             "inverts it")
    if inv is None or not gathers:
        raise NotRouting("the permutation is not inverted, or gathers no rows")
    for g, src, group in gathers:
        s = _val(src)
        if s is None or s.ndim < 1 or s.shape[0] * group != rows:
            raise NotRouting(f"{g.name} gathers rows of a tensor of {getattr(s, 'shape', None)} rows by "
                             f"index // {group}, not one row per routed row")
    return tuple(gathers), tuple(inverse), inv


def _gathered_source(index: fx.Node, by: fx.Node) -> fx.Node:
    if index.target is not aten.index.Tensor or list(index.args[1]) != [by]:
        raise NotRouting(f"{index.format_node()} is not a gather of rows by the permutation")
    return index.args[0]


def _is_inverse(put: fx.Node, perm: fx.Node, rows: int) -> bool:
    """index_put(empty_like(perm), [perm], arange(rows)): inv[perm[i]] = i."""
    base, indices, values = put.args[:3]
    accumulate = put.args[3] if len(put.args) > 3 else put.kwargs.get("accumulate", False)
    return (not accumulate and isinstance(base, fx.Node) and base.target is aten.empty_like.default
            and base.args[0] is perm and list(indices) == [perm] and isinstance(values, fx.Node)
            and values.target is aten.arange.default and list(values.args[:1]) == [rows] and len(values.args) == 1)


def _region(gathers: tuple, offsets: fx.Node, inv: fx.Node, rows: int, num_experts: int
            ) -> tuple[tuple[fx.Node, ...], tuple[fx.Node, ...], fx.Node]:
    """3. The ops from the sorted rows and offsets to the gather by the inverse."""
    inputs = {g for g, _, _ in gathers} | {offsets}
    exits = [u for u in _users(inv)]
    if len(exits) != 1 or exits[0].target is not aten.index.Tensor or list(exits[0].args[1]) != [inv]:
        raise NotRouting("the inverse permutation is not read by one gather of rows")
    exit_ = exits[0]
    graph_order = {n: i for i, n in enumerate(exit_.graph.nodes)}
    region: set[fx.Node] = set()
    frontier = list(inputs)
    while frontier:
        for u in _users(frontier.pop()):
            if u is not exit_ and u not in region:
                region.add(u)
                frontier.append(u)
    if exit_.args[0] not in region:
        raise NotRouting("the rows put back in order are not computed from the sorted rows")
    experts: dict[fx.Node, None] = {}
    for n in region:
        for a in n.all_input_nodes:
            if a in region or a in inputs:
                continue
            v = _val(a)
            if v is not None and v.ndim >= 2 and v.shape[0] == num_experts and _grouped_weight(n, a):
                experts[a] = None
                continue
            raise NotRouting(f"{n.name} reads {a.name}, which is neither a routed row nor an expert's weight")
        v = n.meta.get("val")
        if not (n.target is operator.getitem or (isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == rows)
                or (isinstance(v, (tuple, list)) and all(isinstance(x, torch.Tensor) and x.shape[0] == rows
                                                         for x in v))):
            raise NotRouting(f"{n.name} ({n.target}) does not keep one row per routed row")
    for n in region | set(inputs) - {offsets}:
        outside = [u for u in _users(n) if u not in region and u is not exit_]
        if outside:
            raise NotRouting(f"{n.name} is also read outside the experts, by {outside[0].name}")
    for u in _users(offsets):
        if u not in region or not _grouped_mm(u) or u.args[2] is not offsets:
            raise NotRouting(f"the offsets are read by {u.name}, not only as a grouped matmul's offsets")
    ordered = tuple(sorted(region, key=graph_order.__getitem__))
    experts_ordered = tuple(sorted(experts, key=lambda a: min(graph_order[u] for u in a.users if u in region)))
    return ordered, experts_ordered, exit_


def _grouped_mm(n: fx.Node) -> bool:
    return str(n.target) in _GROUPED_MM


def _grouped_weight(n: fx.Node, a: fx.Node) -> bool:
    return _grouped_mm(n) and n.args[1] is a


def _collapse(gm: fx.GraphModule, r: _Routing) -> None:
    """4. Body graph, routed_experts node, dead ops removed."""
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {r.offsets: body.placeholder("offsets")}
    for i, (g, _, _) in enumerate(r.gathers):
        env[g] = body.placeholder(f"rows_{i}")
    for i, w in enumerate(r.experts):
        env[w] = body.placeholder(f"expert_{i}")
    for n in r.region:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(env[r.exit.args[0]])
    # named within the body, so every layer's alike experts share one body and its name
    # (passes/trace/stretch.py copies a layer's routed_experts call with its body name)
    canonicalise(body)
    name = register_body(fx.GraphModule(torch.nn.Module(), body, class_name="RoutedExpertsBody"))
    graph = gm.graph
    args = (r.ids, [src for _, src, _ in r.gathers], list(r.experts), [group for _, _, group in r.gathers],
            r.num_experts, name)
    with graph.inserting_before(r.exit):
        node = graph.create_node("call_function", ROUTED_EXPERTS, args, name="routed_experts")
    node.meta.update({k: r.exit.meta[k] for k in ("val", "stack_trace", "nn_module_stack") if k in r.exit.meta})
    r.exit.replace_all_uses_with(node)
    # the assertions torch.export kept on the replaced values would keep them alive
    # (an assertion has an effect); the values themselves go with dead-code elimination
    replaced = (r.exit,) + r.region + tuple(g for g, _, _ in r.gathers) + (r.offsets,) + r.dead
    for n in replaced:
        for u in [u for u in n.users if u.target in _ASSERTS]:
            graph.erase_node(u)
