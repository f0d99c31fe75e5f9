"""The recompute family of the ILP (passes/ilp.py states it with the rest of the model):
per repeated block b a binary r[b], recompute b's activations in backward instead of
keeping them, with its price in time and its saving in memory.

    A_b = sum_g sum_i a[b,g,i] s[g,i]      bytes of b's outputs read only inside b
    F_b = sum_g sum_i f[b,g,i] s[g,i] + sum_{e into b} F[e] . x[e]     b's forward again
    y[b] >= A_b - Amax_b r[b],   y[b] >= 0            kept: A_b (1 - r[b])
    z[b] >= F_b - Fmax_b (1 - r[b]),   z[b] >= 0       rerun: F_b r[b]
    r[b] >= r[b']                                     twins b before b'

block_terms prices a[b,g,i] and f[b,g,i] (forward seconds of the block's ops under each
choice, and the forward steps of reshards inside a group into them); recompute adds
r, y, z and their rows. The memory row subtracts A_b and adds y[b]; the time objective
adds z[b] (passes/ilp.py). Amax and Fmax are the largest values A_b and F_b take, so
each row is slack on the side it does not bind.

Why blocks and not single ops: a block is what torch.utils.checkpoint reruns as one
region (passes/recompute.py), what Megatron-LM and torchtitan checkpoint by hand, and
what clustering (passes/clusters.py) already finds; its outputs read further on stay
kept, so recomputing one block never recomputes another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from autopar.core.kinds import NodeKind
from autopar.cost_models.edge_prices import INF, EdgePricer
from autopar.passes.ilp_terms import US, LinearTerms, Variable
from autopar.passes.solver_backend import LinearProgram

if TYPE_CHECKING:  # ilp.py imports this module
    from autopar.passes.ilp import IlpModel


@dataclass(frozen=True)
class BlockTerms:
    """One block's recompute coefficients, per group (its leader) and leader choice."""

    name: str  # the block's module path, e.g. "transformer.h.3"
    nodes: tuple[str, ...]  # its op and getitem nodes, in graph order
    twin: str  # the first block with the same terms (itself if none): twins recompute in order
    dropped: Mapping[str, tuple[int, ...]]  # a[b,g,i] in bytes
    forward_s: Mapping[str, tuple[float, ...]]  # f[b,g,i] in seconds
    edges: tuple[int, ...]  # indices into IlpModel.edges of the edges into b: their forward F reruns


@dataclass(frozen=True)
class RecomputeVariables:
    """Columns per IlpModel.blocks: r (binary), y (kept bytes), z (rerun microseconds)."""

    recomputed: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()
    rerun: tuple[int, ...] = ()


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
    out = []
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
        twin = block_of.get(model.rep.get(names[0], names[0]), key)
        edges = tuple(k for k, e in enumerate(model.edges) if e.consumer.name in inside)
        out.append(BlockTerms(block_name(key), tuple(names), block_name(twin),
                              {g: tuple(a) for g, a in dropped.items()}, {g: tuple(f) for g, f in fwd.items()}, edges))
    return tuple(out)


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
            continue  # an edge between groups: its F rides on its x (passes/ilp.py)
        producer = model.graph.node(u)
        for i, (ui, vi) in enumerate(zip(model.groups[u].index_map, member.index_map)):
            if ui >= 0 and vi >= 0:
                f[i] += forward.cost_s(producer.strategies[ui].outputs[k], node.strategies[vi], pos)


def recompute(prob: LinearProgram, model: "IlpModel", s: Mapping[str, tuple[Variable, ...]],
              rerun: Sequence[LinearTerms]) -> RecomputeVariables:
    """r[b], y[b], z[b] and the rows of the module docstring, per block of `model`;
    `rerun`: the forward part of each edge's reshard terms (ilp.edge_consistency)."""
    r, y, z = [], [], []
    last_of_twins: dict[str, int] = {}
    for block in model.blocks:
        rb, yb, zb = prob.column(binary=True), prob.column(binary=False), prob.column(binary=False)
        a = _on_s(block.dropped, s, 1.0)
        a_max = _bound(block.dropped, s)
        prob.row({**{v: -c for v, c in a.coef.items()}, yb: 1.0, rb: a_max}, 0.0, INF)  # y - A + Amax r >= 0
        f = _on_s(block.forward_s, s, US)
        f_max = _bound(block.forward_s, s) * US
        for k in block.edges:
            f.extend(rerun[k])
            f_max += rerun[k].constant + max(rerun[k].coef.values(), default=0.0)
        f_max = max(f_max, f.constant)
        coef = {v: -c for v, c in f.coef.items()}
        coef[zb], coef[rb] = 1.0, -f_max
        prob.row(coef, f.constant - f_max, INF)  # z - F + Fmax (1 - r) >= 0
        if block.twin in last_of_twins:  # r[earlier twin] - r[b] >= 0
            prob.row({r[last_of_twins[block.twin]]: 1.0, rb: -1.0}, 0.0, INF)
        last_of_twins[block.twin] = len(r)
        r.append(rb)
        y.append(yb)
        z.append(zb)
    return RecomputeVariables(tuple(r), tuple(y), tuple(z))


def _on_s(per_group: Mapping[str, tuple[float, ...]], s: Mapping[str, tuple[Variable, ...]], scale: float) -> LinearTerms:
    terms = LinearTerms()
    for g, values in per_group.items():
        for i, var in enumerate(s[g]):
            if var is not None:
                terms.add(var, values[i] * scale)
    return terms


def _bound(per_group: Mapping[str, tuple[float, ...]], s: Mapping[str, tuple[Variable, ...]]) -> float:
    """The largest sum one choice per group can give (over the choices still possible)."""
    return float(sum(max((values[i] for i, var in enumerate(s[g]) if var is not None), default=0)
                     for g, values in per_group.items()))
