"""The recompute family of the ILP (passes/solve/ilp.py states it with the rest of the model):
per repeated block b a binary r[b], recompute b's activations in backward instead of
keeping them, with its price in time and its saving in memory.

    w[b,g,i] = s[g,i] r[b]:  w <= s[g,i],  sum_i w[b,g,i] = r[b]    (s one-hot in g; also an
                                                            edge's terms on a side's s)
    z[b,e] >= F0[e] + sum_k F[e,k] x[e,k] - Fmax[e] (1 - r[b]),  z >= 0   (x: e's flows, sum 1;
                                                            Fmax = F0 + max_k F[e,k]: big-M)
    dropped bytes   sum_g sum_i a[b,g,i] w[b,g,i]         (b's outputs read only inside b)
    rerun time      sum_g sum_i f[b,g,i] w[b,g,i] + sum_{e into b} z[b,e]
    r[b] >= r[b']                                         twins (equal terms) b before b'

block_terms prices a[b,g,i] and f[b,g,i] (forward seconds of the block's ops under each
choice, and the forward steps of reshards inside a group into them); recompute adds r,
w, z and their rows. The memory row subtracts the dropped bytes, the time objective
adds the rerun time (passes/solve/ilp.py). w is exact for integral s and r (r = 0 forces
w = 0; r = 1 makes it s) and tight: for fractional r the LP sees the dropped bytes and
rerun time in proportion to r, where a big-M form would see far less (GPT-2 small
(2, 4) at 0.3 of its free footprint: a 56 s solve with big-M rows). z, on an edge's
flows, is big-M on purpose (exact at the optimum, as z is minimised): exact products
of an edge's hundreds of flows made the ILP four times larger.

Why blocks and not single ops: a block is what torch.utils.checkpoint reruns as one
region (passes/lower/recompute.py), what Megatron-LM and torchtitan checkpoint by hand, and
what clustering (passes/strategies/clusters.py) already finds; its outputs read further on stay
kept, so recomputing one block never recomputes another.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Sequence

from autopar.core.kinds import NodeKind
from autopar.cost_models.edge_prices import INF, EdgePricer
from autopar.passes.solve.ilp_terms import US, LinearTerms, Variable
from autopar.passes.solve.solver_backend import LinearProgram

if TYPE_CHECKING:  # ilp.py imports this module
    from autopar.passes.solve.ilp import IlpModel


@dataclass(frozen=True)
class BlockTerms:
    """One block's recompute coefficients, per group (its leader) and leader choice."""

    name: str  # the block's module path, e.g. "transformer.h.3"
    nodes: tuple[str, ...]  # its op and getitem nodes, in graph order
    twin: str  # the first block with the same terms (_signature; itself if none): twins recompute in order
    dropped: Mapping[str, tuple[int, ...]]  # a[b,g,i] in bytes
    forward_s: Mapping[str, tuple[float, ...]]  # f[b,g,i] in seconds
    edges: tuple[int, ...]  # indices into IlpModel.edges of the edges into b: their forward F reruns


@dataclass(frozen=True)
class RecomputeVariables:
    """Per IlpModel.blocks: r (a column), the bytes recompute drops, sum a w, and the
    time it adds, sum f w + sum z (in microseconds)."""

    recomputed: tuple[int, ...] = ()
    dropped: tuple[LinearTerms, ...] = ()
    rerun: tuple[LinearTerms, ...] = ()


def block_name(key: tuple[str, int]) -> str:
    return f"{key[0]}.{key[1]}" if key[0] else str(key[1])


def block_terms(model: "IlpModel", block_of: Mapping[str, tuple[str, int]], forward: EdgePricer,
                forward_s: Mapping[str, Sequence[float]], nbytes: Mapping[str, Sequence[int]]
                ) -> tuple[BlockTerms, ...]:
    """The terms of every block (passes/clusters.find_blocks) whose recompute would drop
    some bytes; `forward_s` and `nbytes`: per node and strategy, forward seconds (no
    backward share) and bytes per rank, as solve.py prices them."""
    graph = model.graph
    members: dict[tuple[str, int], list[str]] = {}
    for n in graph.nodes:
        if n.name in block_of and not n.kind.is_input and n.kind is not NodeKind.OUTPUT:
            members.setdefault(block_of[n.name], []).append(n.name)
    read_by: dict[str, set[str]] = {}
    for n in graph.nodes:
        for u, _ in n.inputs:
            read_by.setdefault(u, set()).add(n.name)
    out: list[BlockTerms] = []
    first_with: dict[tuple, str] = {}  # a block's terms -> the first block with them
    for key in sorted(members):
        names = members[key]
        inside = set(names)
        dropped: dict[str, list[int]] = {}
        fwd: dict[str, list[float]] = {}
        for name in names:
            kept = any(v not in inside for v in read_by.get(name, ()))
            _add_node(model, name, kept, forward, forward_s, nbytes, dropped, fwd)
        if not any(any(a) for a in dropped.values()):
            continue
        edges = tuple(k for k, e in enumerate(model.edges) if e.consumer.name in inside)
        terms = BlockTerms(block_name(key), tuple(names), "", {g: tuple(a) for g, a in dropped.items()},
                           {g: tuple(f) for g, f in fwd.items()}, edges)
        out.append(replace(terms, twin=first_with.setdefault(_signature(model, terms), terms.name)))
    return tuple(out)


def _signature(model: "IlpModel", block: BlockTerms) -> tuple:
    """What r[b] is priced with: a and f on the variables they use (a copy's group on
    its representative's s) and the edges into b by the x they share (Edge.twin_key).
    Blocks with one signature are interchangeable, so ordering their r loses nothing;
    a clustered block whose input edge comes from an unclustered one (the first copy)
    prices its rerun on other variables and is no twin of the rest."""
    on_owner = lambda per_group: tuple((model.owner(g), v) for g, v in per_group.items())  # noqa: E731
    return (on_owner(block.dropped), on_owner(block.forward_s),
            tuple(model.edges[k].twin_key(model.rep) for k in block.edges))


def _add_node(model: "IlpModel", name: str, kept: bool, forward: EdgePricer, forward_s: Mapping[str, Sequence[float]],
              nbytes: Mapping[str, Sequence[int]], dropped: dict[str, list[int]], fwd: dict[str, list[float]]) -> None:
    """a and f of one node of a block, on its group's leader choices: its bytes unless
    `kept` (read outside the block), its forward seconds, and the forward steps of the
    reshards inside its group into it."""
    node, member = model.graph.node(name), model.groups[name]
    width = len(member.index_map)
    a = dropped.setdefault(member.leader, [0] * width)
    f = fwd.setdefault(member.leader, [0.0] * width)
    for i, j in enumerate(member.index_map):
        if j >= 0:
            a[i] += 0 if kept else nbytes[name][j]
            f[i] += forward_s[name][j]
    for pos, (u, k) in enumerate(node.inputs):
        if model.groups[u].leader != member.leader:
            continue  # an edge between groups: its F rides on its x (passes/solve/ilp.py)
        producer = model.graph.node(u)
        for i, (ui, vi) in enumerate(zip(model.groups[u].index_map, member.index_map)):
            if ui >= 0 and vi >= 0:
                f[i] += forward.cost_s(producer.strategies[ui].outputs[k], node.strategies[vi], pos)


def recompute(prob: LinearProgram, model: "IlpModel", s: Mapping[str, tuple[Variable, ...]],
              rerun: Sequence[LinearTerms]) -> RecomputeVariables:
    """r[b], the products w = s r[b] and the edges' z with their rows (module docstring),
    and per block the terms sum a w (bytes) and sum f w + sum z (microseconds);
    `rerun`: the forward part of each edge's reshard terms (ilp.edge_consistency)."""
    one_hot = {var: vars_ for g in model.leaders for vars_ in [s[g]] for var in vars_ if var is not None}
    r: list[int] = []
    dropped, again = [], []
    last_of_twins: dict[str, int] = {}
    for block in model.blocks:
        rb = prob.column(binary=True)
        product: dict[int, int] = {}  # column c -> the column of c r[b]
        kept, rerun_b = LinearTerms(), LinearTerms()
        for per_group, terms, scale in ((block.dropped, kept, 1.0), (block.forward_s, rerun_b, US)):
            for g, values in per_group.items():
                for i, var in enumerate(s[g]):
                    if var is not None and values[i]:
                        terms.add(_times(prob, var, rb, one_hot[var], product), values[i] * scale)
        for k in block.edges:
            if any(not prob.binary[c] for c in rerun[k].coef):
                rerun_b.add(_flows_times_r(prob, rerun[k], rb), 1.0)
                continue
            rerun_b.add(rb, rerun[k].constant)
            for c, coef in rerun[k].coef.items():
                rerun_b.add(_times(prob, c, rb, one_hot[c], product), coef)
        if block.twin in last_of_twins:  # r[earlier twin] - r[b] >= 0
            prob.row({r[last_of_twins[block.twin]]: 1.0, rb: -1.0}, 0.0, INF)
        last_of_twins[block.twin] = len(r)
        r.append(rb)
        dropped.append(kept)
        again.append(rerun_b)
    return RecomputeVariables(tuple(r), tuple(dropped), tuple(again))


def _flows_times_r(prob: LinearProgram, terms: LinearTerms, rb: int) -> int:
    """A column z with z >= F - Fmax (1 - r[b]), z >= 0, for an edge's forward terms F on
    its flows (at most one flow pair is chosen, so Fmax = F0 + the largest coefficient):
    z = F r[b] where z is minimised. Big-M on purpose: exact products of an edge's
    hundreds of flows made the ILP four times larger and slower."""
    z = prob.column(binary=False)
    f_max = terms.constant + max(terms.coef.values(), default=0.0)
    prob.row({**{c: -v for c, v in terms.coef.items()}, z: 1.0, rb: -f_max}, terms.constant - f_max, INF)
    return z


def _times(prob: LinearProgram, col: int, rb: int, family: Sequence[Variable], product: dict[int, int]) -> int:
    """The column of col r[b]; made with its family's (the one-hot s of its group, or the
    flows x of its edge, which sum to 1): w <= col for each, sum w = r[b]."""
    if col not in product:
        total = {rb: -1.0}
        for c in family:
            if c is not None:
                product[c] = w = prob.column(binary=False)
                prob.row({w: 1.0, c: -1.0}, -INF, 0.0)
                total[w] = 1.0
        prob.row(total, 0.0, 0.0)
    return product[col]
