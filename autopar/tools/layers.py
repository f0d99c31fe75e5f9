"""A plan grouped by layer: what the HTML report's table and layer graph and the
matplotlib figures draw (autopar/tools/report.py, report_svg.py, visualize.py).

    layer_rows(plan)    one LayerRow per layer in program order: a repeated block such as
                        model.layers.3 is a row of its own, a module outside any block
                        its first two name parts (model.embed_tokens), graph inputs and
                        ops outside every module a row each
    layer_graph(plan)   the rows as boxes, runs of identical consecutive blocks collapsed
                        into one box (transformer.h.0-11 x12), and the plan's edges between
                        two boxes gathered into one link per (from, to) pair, labelled with
                        the collectives they carry

Every node is in one row and every edge in one place: inside a box where producer and
consumer share it, else on the link between their boxes. A parameter sits in the row of
its first consumer (so a block's weights are the block's), other graph inputs in a row
of their own.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from autopar.core.kinds import NodeKind
from autopar.core.plan import Plan
from autopar.core.plan_parts import EdgePlan, NodeChoice
from autopar.core.resharding import Step

MIB = 2**20
INPUTS_ROW = "(graph inputs)"  # user inputs, buffers, and parameters no op reads (a tied weight's twin)
TOP_ROW = "(top level)"  # ops outside every submodule: the loss, the output


@dataclass(frozen=True)
class LayerRow:
    """What one row of the layer table shows."""

    name: str
    params: tuple[tuple[str, str], ...]  # (short name, placement)
    outputs: tuple[tuple[str, int], ...]  # (placement, how many op outputs have it), most first
    edges: tuple[EdgePlan, ...]  # edges into the layer's nodes that move bytes, forward or backward
    nodes: tuple[NodeChoice, ...]
    compute_s: float
    comm_s: float


def layer_key(module: str) -> str:
    """The row a module belongs to: 'model.layers.3.mlp.up_proj' -> 'model.layers.3' (a
    repeated block, cut after its index); 'model.embed_tokens.x' -> 'model.embed_tokens'."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", module)
    if m:
        return m.group(1)
    return ".".join(module.split(".")[:2]) if module else TOP_ROW


def moves(edge: EdgePlan) -> tuple[Step, ...]:
    """The edge's steps that communicate, forward or backward."""
    return tuple(s for s in edge.steps if s.kind.communicates or s.backward.communicates)


def communicates(edge: EdgePlan) -> bool:
    """Moves bytes forward, or backward at a price (a grad sync of an integer input costs nothing)."""
    return any(s.kind.communicates for s in edge.steps) or (edge.comm_s > 0 and bool(moves(edge)))


def kinds(edge: EdgePlan) -> str:
    """'all_gather axis 0 (backward reduce_scatter) + slice axis 1 (backward all_gather)'."""
    return " + ".join(f"{s.kind} axis {s.axis}" + (f" (backward {s.backward})" if s.backward.communicates else "")
                      for s in moves(edge))


def edge_mib(edge: EdgePlan, plan: Plan) -> float:
    """The bytes one rank puts into the edge's moving steps (each step's local input)."""
    return sum(s.before.local_nbytes(plan.mesh.shape) for s in moves(edge) if s.before is not None) / MIB


def row_of(plan: Plan) -> dict[str, str]:
    """Each node's row (module docstring)."""
    return {name: row for name, (row, _) in _placed(plan).items()}


def _placed(plan: Plan) -> dict[str, tuple[str, int]]:
    """node -> (its row, the program position that places it: -1 for graph inputs)."""
    position = {n.name: i for i, n in enumerate(plan.nodes)}
    first_use: dict[str, int] = {}
    for e in plan.edges:
        first_use[e.producer] = min(first_use.get(e.producer, len(position)), position.get(e.consumer, len(position)))
    where: dict[str, tuple[str, int]] = {}
    for i, n in enumerate(plan.nodes):
        if n.kind is NodeKind.PARAMETER and first_use.get(n.name, len(position)) < len(position):
            where[n.name] = (layer_key(plan.nodes[first_use[n.name]].module), first_use[n.name])
        else:
            where[n.name] = (INPUTS_ROW, -1) if n.kind.is_input else (layer_key(n.module), i)
    return where


def layer_rows(plan: Plan) -> list[LayerRow]:
    """The layer table's rows in program order (a row starts where its first node is placed)."""
    return _rows(plan, _placed(plan))


def _rows(plan: Plan, where: dict[str, tuple[str, int]]) -> list[LayerRow]:
    starts: dict[str, int] = {}
    for row, i in where.values():
        starts[row] = min(starts.get(row, i), i)
    rows = []
    for name in sorted(starts, key=starts.__getitem__):
        nodes = tuple(n for n in plan.nodes if where[n.name][0] == name)
        edges = tuple(e for e in plan.edges
                      if where.get(e.consumer, ("", 0))[0] == name and communicates(e))
        outputs = Counter(str(n.outputs[0]) for n in nodes if not n.kind.is_input and n.outputs)
        params = tuple((_short(n.name, name), str(n.outputs[0])) for n in nodes
                       if n.kind is NodeKind.PARAMETER and n.outputs)
        rows.append(LayerRow(name, params, tuple(outputs.most_common()), edges, nodes,
                             sum(n.compute_s for n in nodes), sum(e.comm_s for e in edges)))
    return rows


def _short(param: str, row: str) -> str:
    """'p_model_layers_0_mlp_up_proj_weight' in row 'model.layers.0' -> 'mlp_up_proj_weight'."""
    name = param[2:] if param.startswith("p_") else param
    prefix = row.replace(".", "_") + "_"
    return name[len(prefix):] if name.startswith(prefix) else name


# ---- the layer graph -----------------------------------------------------------------
@dataclass(frozen=True)
class LayerBox:
    """One box of the layer graph: a row, or a run of identical consecutive blocks."""

    name: str  # 'transformer.h.0' or, for a run, 'transformer.h.0-11'
    rows: tuple[LayerRow, ...]
    placement: str  # the placement most of its op outputs have ('' for graph inputs)
    compute_s: float
    inner_s: float  # communication on edges whose producer and consumer are both in the box
    inner: tuple[tuple[str, int], ...]  # the collectives of those edges: (kinds, count), dearest first

    @property
    def repeats(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class LayerLink:
    """The plan's edges from one box to a later one (or back, for a tied weight)."""

    source: str
    target: str
    edges: int
    collectives: tuple[tuple[str, int], ...]  # (kinds, count) of the edges that move bytes, dearest first
    mib: float  # what one rank sends on them
    comm_s: float

    @property
    def communicates(self) -> bool:
        return bool(self.collectives)

    def label(self, most: int = 2) -> str:
        """'all_reduce axis 1 x2, slice axis 0 x1: 0.50 MiB, 0.120 ms' (the dearest kinds first)."""
        shown = ", ".join(f"{k} x{c}" for k, c in self.collectives[:most])
        more = f", +{len(self.collectives) - most} more" if len(self.collectives) > most else ""
        return f"{shown}{more}: {self.mib:.2f} MiB, {self.comm_s * 1e3:.3f} ms"


@dataclass(frozen=True)
class LayerGraph:
    boxes: tuple[LayerBox, ...]  # in program order
    links: tuple[LayerLink, ...]  # in order of (source box, target box)


def _shape(row: LayerRow) -> tuple:
    """What makes two blocks' rows the same picture: the name with its index dropped, the
    placements of parameters and outputs, the collectives on the edges into it."""
    return (re.sub(r"\.\d+$", "", row.name), row.params, row.outputs,
            tuple(sorted(Counter(kinds(e) for e in row.edges).items())))


def _runs(rows: list[LayerRow], collapse: bool) -> list[tuple[LayerRow, ...]]:
    """Consecutive rows of one shape, each a numbered block (name ending in .N), in runs."""
    runs: list[list[LayerRow]] = []
    for row in rows:
        last = runs[-1][-1] if runs else None
        if (collapse and last is not None and re.search(r"\.\d+$", row.name)
                and _shape(last) == _shape(row)):
            runs[-1].append(row)
        else:
            runs.append([row])
    return [tuple(r) for r in runs]


def _run_name(run: tuple[LayerRow, ...]) -> str:
    if len(run) == 1:
        return run[0].name
    return f"{run[0].name}-{run[-1].name.rsplit('.', 1)[1]}"


def _tally(edges: list[EdgePlan]) -> tuple[tuple[str, int], ...]:
    """(kinds, count) of the edges that move bytes, the dearest kind first."""
    price: dict[str, float] = {}
    count: Counter = Counter()
    for e in edges:
        if communicates(e):
            k = kinds(e)
            count[k] += 1
            price[k] = price.get(k, 0.0) + e.comm_s
    return tuple((k, count[k]) for k in sorted(count, key=lambda k: (-price[k], k)))


def layer_graph(plan: Plan, collapse: bool = True) -> LayerGraph:
    """The plan as boxes and links (module docstring); `collapse=False` keeps every block a box."""
    where = _placed(plan)
    runs = _runs(_rows(plan, where), collapse)
    box_of_row = {row.name: _run_name(run) for run in runs for row in run}
    box_of = {node: box_of_row[row] for node, (row, _) in where.items()}
    inside: dict[str, list[EdgePlan]] = {}
    between: dict[tuple[str, str], list[EdgePlan]] = {}
    for e in plan.edges:
        a, b = box_of[e.producer], box_of[e.consumer]
        if a == b:
            inside.setdefault(a, []).append(e)
        else:
            between.setdefault((a, b), []).append(e)
    boxes = []
    for run in runs:
        name = _run_name(run)
        outputs = Counter()
        for r in run:
            outputs.update(dict(r.outputs))
        edges = inside.get(name, [])
        boxes.append(LayerBox(name, run, outputs.most_common(1)[0][0] if outputs else "",
                              sum(r.compute_s for r in run), sum(e.comm_s for e in edges), _tally(edges)))
    order = {b.name: i for i, b in enumerate(boxes)}
    links = tuple(LayerLink(a, b, len(edges), _tally(edges), sum(edge_mib(e, plan) for e in edges if communicates(e)),
                            sum(e.comm_s for e in edges))
                  for (a, b), edges in sorted(between.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])))
    return LayerGraph(tuple(boxes), links)


@dataclass(frozen=True)
class Route:
    """Where a drawing puts a link: from box `source` to box `target` (their places in the
    column), straight down when they are neighbours (lane 0), else an arc on the right in
    lane 1, 2, ..., the links that skip fewest boxes innermost."""

    link: LayerLink
    source: int
    target: int
    lane: int


def routes(graph: LayerGraph) -> list[Route]:
    """Every link's route, inner lanes first (what the HTML report and the matplotlib figure draw)."""
    index = {b.name: i for i, b in enumerate(graph.boxes)}
    out, lane = [], 0
    for link in sorted(graph.links, key=lambda k: abs(index[k.target] - index[k.source])):
        a, b = index[link.source], index[link.target]
        if b != a + 1:
            lane += 1
        out.append(Route(link, a, b, 0 if b == a + 1 else lane))
    return out
