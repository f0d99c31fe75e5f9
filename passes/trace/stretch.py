"""The traced graph of a model of L alike blocks, built from the trace of its first few.

    trace of the model cut to blocks 0..3 (first, two inner, last)
        --block 2 copied as blocks 3 .. L-2, block 3 renamed L-1--> graph of L blocks

torch.export's cost grows with the model's depth (Llama-3-8B: about 6 s for 32 blocks,
the 405B shape about 19 s for 126), and every block past the second inner one traces to
the same ops. So a planner that needs the whole graph can trace four blocks and copy
the third: each copy reads what the copy before it made, where the third block reads
the second's output, and the values made outside the blocks (rotary tables, masks)
that the third reads; its parameters are the next block's. The last block then reads
the last copy. The result is canonicalised (passes/trace/canonical.py) like any trace,
so its order, names and fingerprint are what tracing all L blocks gives: tests check
that they are equal, and a caller that cannot stretch (None) traces the whole model.

Blocks before the first alike one (DeepSeek-V3's dense layers before its expert layers)
are traced too and kept as they are: the sample is those and four alike blocks.

Stretching refuses (None) where the two inner blocks are not wired alike (a block that
reads two blocks back, one with its own constants or submodule bodies), where anything
outside the blocks reads an inner block (a model that returns every block's hidden
states), and where the trace has buffer writes or symbolic sizes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
import re
from typing import Any, Callable, Iterator, Optional

import torch
from torch import fx, nn

from autopar.core.errors import TraceError
from autopar.core.kinds import NodeKind
from autopar.passes.trace.canonical import canonicalise
from autopar.passes.trace.trace import GraphInput, TracedGraph, fingerprint, trace

SAMPLE = 4  # the blocks traced: first, two inner (compared with each other), last
PLAIN_TYPES = (bool, int, float, str, tuple, type(None))
# what torch.export's nn_module_stack records for a module under the trace's wrapper (_TensorLeafCall.model)
WRAPPER = "model"


@dataclass(frozen=True)
class BlockSample:
    """Where the model's blocks live and how many there are (what stretched restores)."""

    container: str  # module path of the ModuleList, as the traced graph names it ("model.layers")
    blocks: int
    first: int = 0  # the first of the alike blocks: those before it differ (DeepSeek-V3's dense layers)

    @property
    def span(self) -> "BlockSpan":
        """What the trace of the model cut to this sample (cut) holds and stands for."""
        return BlockSpan(self.container, tuple(range(self.first, self.first + SAMPLE)), self.blocks - 1)


@dataclass(frozen=True)
class BlockSpan:
    """The SAMPLE alike blocks a trace holds, by the index the trace names each with, and
    the index the last of them stands for: the blocks between the third and the last are
    copies of the third (the first three keep their indices). Any blocks the trace holds
    before the first are unlike ones, kept as they are."""

    container: str
    traced: tuple[int, ...]  # SAMPLE block indices, ascending
    last: int  # the index the last traced block gets


def alike_blocks(model: nn.Module, after_unlike: bool = False) -> Optional[BlockSample]:
    """The model's block container (of the ModuleLists and Sequentials outside any block,
    as passes/strategies/clusters.py finds blocks, the one with the most children) when
    it has more than SAMPLE blocks and they are alike (module docstring); else None.
    `after_unlike`: the blocks from some block on are alike, and more than SAMPLE."""
    lists = [(len(m), path) for path, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and path and len(m) > SAMPLE
             and not any(part.isdigit() for part in path.split("."))]  # not inside a block (experts)
    if not lists:
        return None
    _, path = min(lists, key=lambda x: (-x[0], x[1]))
    signatures = [_signature(b) for b in model.get_submodule(path)]
    for first in range(len(signatures) - SAMPLE if after_unlike else 1):
        if all(_alike(signatures[first], signatures[place], first, place)
               for place in range(first + 1, len(signatures))):
            return BlockSample(path, len(signatures), first)
    return None


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


def _alike(first: tuple, other: tuple, first_place: int, place: int) -> bool:
    """Signatures equal, but for integers that count the block's place: `first_place` in
    the first block, `place` in the other (transformers' layer_idx)."""
    if first[0] != other[0] or len(first[1]) != len(other[1]):
        return False
    for (name, kind, plain), (name2, kind2, plain2) in zip(first[1], other[1]):
        if (name, kind, len(plain)) != (name2, kind2, len(plain2)):
            return False
        for (k, v), (k2, v2) in zip(plain, plain2):
            counts = type(v) is int and type(v2) is int and (v, v2) == (first_place, place)
            if k != k2 or (v != v2 and not counts):
                return False
    return True


@contextmanager
def cut(model: nn.Module, sample: BlockSample) -> Iterator[None]:
    """The model with its block container holding the blocks before the sample's first and
    SAMPLE blocks from it, for the duration."""
    def kept(whole: nn.Module) -> nn.Module:
        blocks = list(whole)[:sample.first + SAMPLE]
        return type(whole)(*blocks) if isinstance(whole, nn.Sequential) else nn.ModuleList(blocks)
    with replaced(model, sample.container, kept):
        yield


@contextmanager
def replaced(model: nn.Module, path: str, make: Callable[[nn.Module], nn.Module]) -> Iterator[None]:
    """The model with its submodule at `path` replaced by make(that submodule), for the duration."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    whole = parent._modules[name]
    parent._modules[name] = make(whole)
    try:
        yield
    finally:
        parent._modules[name] = whole


def stretched_trace(model: nn.Module, args: tuple, kwargs: dict, param_dtype: Optional[torch.dtype] = None
                    ) -> TracedGraph:
    """trace(model, args, kwargs, param_dtype), made from a trace of its first SAMPLE blocks
    where its blocks are alike and the sample stretches (module docstring)."""
    sample = alike_blocks(model, after_unlike=True)
    if sample is not None:
        try:
            with cut(model, sample):
                short = trace(model, args, kwargs, param_dtype)
        except TraceError:  # a forward that needs all its blocks
            short = None
        whole = stretched_graph(short, sample) if short is not None else None
        if whole is not None:
            return whole
    return trace(model, args, kwargs, param_dtype)


Wiring = tuple  # per node of a block: (op, target, args and kwargs with inputs as (where, position))


def stretched_graph(traced: TracedGraph, sample: BlockSample) -> Optional[TracedGraph]:
    """`traced` (of the model cut to `sample`: cut) with its block
    sample.first + SAMPLE - 2 copied to make sample.blocks blocks (module docstring), or
    None where the sample does not stand for the rest. The blocks before sample.first stay
    as traced."""
    return stretched_span(traced, sample.span)


def stretched_span(traced: TracedGraph, span: BlockSpan) -> Optional[TracedGraph]:
    """`traced`, holding the blocks of `span`, with the third of them copied into each
    index between it and span.last and the last block named span.last (BlockSpan), or
    None where the sample does not stand for the rest (module docstring)."""
    inner_index = span.traced[SAMPLE - 2]
    if span.last - inner_index < 2 or traced.buffer_updates or traced.symbolic:  # no block to copy
        return None
    by_name = {gi.name: gi for gi in traced.inputs}
    owner = _block_owner(traced.gm, by_name, span.container, span.traced)
    if owner is None:
        return None
    position = {index: place for place, index in enumerate(span.traced)}
    owner = {n: position[b] for n, b in owner.items() if b in position}  # the sample's blocks 0..SAMPLE-1
    members: list[list[fx.Node]] = [[] for _ in range(SAMPLE)]
    for node in traced.gm.graph.nodes:
        if node in owner:
            members[owner[node]].append(node)
    for b in range(SAMPLE):
        members[b] = _ordered(members[b], members[b - 1] if b else [], owner)
    inner, last = SAMPLE - 2, SAMPLE - 1
    wiring = [_wiring(members[b], members[b - 1], owner) for b in range(1, SAMPLE)]
    if any(w is None for w in wiring) or wiring[inner - 1] != wiring[inner - 2]:
        return None
    outside_reads = {owner.get(i) for n in traced.gm.graph.nodes if n not in owner for i in n.all_input_nodes}
    if outside_reads & set(range(1, last)):
        return None
    return _build(traced, span, members, owner, by_name)


def _block_owner(gm: fx.GraphModule, by_name: dict[str, GraphInput], container: str, sample: tuple[int, ...]
                 ) -> Optional[dict[fx.Node, int]]:
    """Each node of a block -> the block's index: a parameter or buffer by its state-dict
    name, an op by the innermost module it ran in, or, run outside every module, when it
    reads one block's state alone (the casts of Options.param_dtype, made by the trace's
    wrapper); None where the sample's blocks are not all there, other blocks than those
    before the sample's are, or a block holds anything but parameters, buffers and ops."""
    state = re.compile(rf"^{re.escape(container)}\.(\d+)\.")
    module = re.compile(rf"^{re.escape(WRAPPER)}\.{re.escape(container)}\.(\d+)(\.|$)")
    owner: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            gi = by_name[node.name]
            match = state.match(gi.target) if isinstance(gi.target, str) else None
            if match is not None and gi.kind not in (NodeKind.PARAMETER, NodeKind.BUFFER):
                return None
        elif node.op == "call_function":
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            match = next((m for path, _ in reversed(stack) for m in [module.match(path)] if m), None)
            reads = {owner.get(a) if a.op == "placeholder" else None for a in node.all_input_nodes}
            if match is None and len(reads) == 1 and None not in reads:
                owner[node] = reads.pop()
        else:
            match = None
            if node.op == "get_attr" and any(u.op != "output" for u in node.users):
                return None  # a submodule body: each block's own in a whole trace
        if match is not None:
            owner[node] = int(match.group(1))
    found = set(owner.values())
    return owner if found >= set(sample) and all(b < sample[0] for b in found - set(sample)) else None


def _ordered(nodes: list[fx.Node], before: list[fx.Node], owner: dict[fx.Node, int]) -> list[fx.Node]:
    """A block's nodes in an order that matches node for node between alike blocks: those
    the output depends on in graph order (the canonical post-order, the same in every
    block), then the unread ones (assertions, which canonical order sorts by a hash of
    everything upstream) by what they read."""
    unread = [n for n in nodes if n.op == "call_function" and not n.users]
    read = [n for n in nodes if n.op != "call_function" or n.users]
    mine, prev = {n: i for i, n in enumerate(read)}, {n: i for i, n in enumerate(before)}

    def key(n: fx.Node) -> str:
        place = fx.node.map_arg((n.args, n.kwargs), lambda a: (0, mine[a]) if a in mine else
                                (1, prev[a]) if a in prev else (2, owner.get(a, -1), a.name))
        return repr((str(n.target), place))
    return read + sorted(unread, key=key)


def _wiring(nodes: list[fx.Node], before: list[fx.Node], owner: dict[fx.Node, int]) -> Optional[Wiring]:
    """What a block computes, with its inputs named by where they stand: its own nodes and
    the block before's by position, a node outside the blocks by itself; None where it
    reads any other block."""
    mine, prev = {n: i for i, n in enumerate(nodes)}, {n: i for i, n in enumerate(before)}

    def where(a: fx.Node):
        if a in mine:
            return ("self", mine[a])
        if a in prev:
            return ("prev", prev[a])
        if a in owner:
            raise LookupError
        return ("outside", a.name)
    try:
        return tuple((n.op, str(n.target) if n.op != "placeholder" else "", fx.node.map_arg((n.args, n.kwargs), where),
                      _value(n)) for n in nodes)
    except LookupError:
        return None


def _build(traced: TracedGraph, span: BlockSpan, members: list[list[fx.Node]],
           owner: dict[fx.Node, int], by_name: dict[str, GraphInput]) -> Optional[TracedGraph]:
    inner, last = SAMPLE - 2, SAMPLE - 1
    container, named, old, graph = span.container, span.traced, traced.gm.graph, fx.Graph()
    env: dict[fx.Node, fx.Node] = {}  # old node -> new, for everything but the copies
    inputs: list[GraphInput] = []
    copies = range(named[inner] + 1, span.last)  # the new blocks' indices
    copied: dict[int, dict[fx.Node, fx.Node]] = {}  # index -> block `inner`'s node -> its copy

    def renamed(node: fx.Node, index: int) -> Optional[GraphInput]:
        """The placeholder of `node`'s state in block `index`: torch.export names it after
        the state-dict name, underscored and lower-cased ('p_model_layers_3_mlp_up_proj_weight')."""
        gi = by_name[node.name]
        here = f"_{container.replace('.', '_').lower()}_{named[owner[node]]}_"
        if node.name.count(here) != 1:
            return None
        name = node.name.replace(here, f"_{container.replace('.', '_').lower()}_{index}_")
        return GraphInput(name, gi.kind, _at(gi.target, container, index), gi.meta)

    # placeholders: the copies' after the inner block's, kind by kind (state-dict order)
    placeholders = [n for n in old.nodes if n.op == "placeholder"]
    last_inner = {by_name[n.name].kind: n for n in placeholders if owner.get(n) == inner}
    for node in placeholders:
        gi = by_name[node.name]
        if owner.get(node) == last:
            gi = renamed(node, span.last)
        if gi is None:
            return None
        env[node] = _placeholder(graph, node, gi.name)
        inputs.append(gi)
        if last_inner.get(gi.kind) is node:
            for index in copies:
                for twin in (n for n in placeholders if owner.get(n) == inner and by_name[n.name].kind is gi.kind):
                    new = renamed(twin, index)
                    if new is None:
                        return None
                    copied.setdefault(index, {})[twin] = _placeholder(graph, twin, new.name)
                    inputs.append(new)
    # ops: those not after the last block, then the copies, then the last block and what reads it
    after = _downstream(members[last], old)
    ops = [n for n in old.nodes if n.op != "placeholder"]
    for node in (n for n in ops if n not in after):
        env[node] = graph.node_copy(node, lambda a: env[a])
    twin_of = dict(zip(members[inner - 1], members[inner]))  # the block before's node -> the inner block's
    for index in copies:
        previous = copied[index - 1] if index - 1 > named[inner] else env  # env: the inner block itself
        mine = copied.setdefault(index, {})  # a block without state has no placeholders to start it
        for node in (n for n in members[inner] if n.op != "placeholder"):
            mine[node] = graph.node_copy(node, lambda a: mine[a] if owner.get(a) == inner else
                                         previous[twin_of[a]] if owner.get(a) == inner - 1 else env[a])
            _move_module_path(mine[node], container, named[inner], index)
    final = copied[span.last - 1]  # the last copy: what the last block reads for the inner block's values
    for node in (n for n in ops if n in after):
        env[node] = graph.node_copy(node, lambda a: final[a] if owner.get(a) == inner else env[a])
        if owner.get(node) == last:
            _move_module_path(env[node], container, named[last], span.last)
    canonicalise(graph)
    gm = fx.GraphModule(traced.gm, graph)
    return replace(traced, gm=gm, inputs=tuple(inputs), fingerprint=fingerprint(gm))


def _value(node: fx.Node) -> Optional[tuple]:
    val = node.meta.get("val")
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


def _downstream(roots: list[fx.Node], graph: fx.Graph) -> set[fx.Node]:
    """`roots` and every node that reads them, directly or not (but the output)."""
    out, todo = set(roots), list(roots)
    while todo:
        for user in todo.pop().users:
            if user not in out and user.op != "output":
                out.add(user)
                todo.append(user)
    out.update(n for n in graph.nodes if n.op == "output")
    return out


def _placeholder(graph: fx.Graph, like: fx.Node, name: str) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(like.meta)
    return node


def _at(target: str, container: str, index: int) -> str:
    """A state-dict name in block `index` of `container` instead of its own block."""
    return re.sub(rf"^({re.escape(container)})\.\d+\.", rf"\g<1>.{index}.", target)


def _move_module_path(node: fx.Node, container: str, old: int, new: int) -> None:
    """The node's module stack as if it ran in block `new` (a copy's meta is a shallow copy)."""
    prefix, moved = f"{WRAPPER}.{container}.{old}", f"{WRAPPER}.{container}.{new}"
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return
    node.meta["nn_module_stack"] = {
        key: (moved + path[len(prefix):] if path == prefix or path.startswith(prefix + ".") else path, kind)
        for key, (path, kind) in stack.items()}
