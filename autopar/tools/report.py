"""A plan as one self-contained HTML page: inline CSS and SVG, no script, no network.

    write_html(plan, "plan.html")      # also autopar.plan_report(plan, "plan.html")

The page, top to bottom:
    summary     plan.summary()'s lines
    colours     every placement the plan uses, in its fixed colour (autopar/tools/palette.py)
    memory      per rank: parameters, gradients + optimizer state, activations, against
                the device preset's capacity (autopar/tools/report_svg.py)
    timeline    one step in program order: each node's compute, each edge's collectives,
                the share the cost model hides under compute (autopar/tools/report_svg.py)
    layers      one row per layer (a repeated block such as model.layers.3 is a row of its
                own): parameter placements, op output placements, collectives with their
                MiB and predicted ms, and every node behind a <details>

A pipelined plan gets the memory, timeline and layers of each stage's plan in turn.

Plan.to_html does not exist: the Plan lives in autopar/core, which never imports the
tools layer (tests/test_layers.py), not even inside a method; this module is the door.
"""

from __future__ import annotations

import html
import os
import re
import secrets
from collections import Counter
from dataclasses import dataclass

from autopar.core.errors import PlanFileError
from autopar.core.kinds import NodeKind
from autopar.core.plan import Plan
from autopar.core.plan_parts import EdgePlan, NodeChoice
from autopar.core.resharding import Step
from autopar.tools.palette import placement_colour, text_colour
from autopar.tools.report_svg import memory_svg, timeline_svg

MIB = 2**20
INPUTS_ROW = "(graph inputs)"  # user inputs, buffers, and parameters no op reads (a tied weight's twin)
TOP_ROW = "(top level)"  # ops outside every submodule: the loss, the output

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1360px; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 17px; margin: 28px 0 8px; }
pre.summary { background: #f6f6f6; padding: 10px; border: 1px solid #ddd; white-space: pre-wrap; }
.chip { display: inline-block; padding: 1px 6px; margin: 1px 2px; border-radius: 4px;
        font: 12px ui-monospace, monospace; white-space: nowrap; }
table.layers { border-collapse: collapse; width: 100%; font-size: 13px; }
table.layers th, table.layers td { border: 1px solid #ddd; padding: 4px 6px; vertical-align: top; text-align: left; }
table.layers th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
ul.comms { margin: 0; padding-left: 16px; } ul.comms li { margin: 1px 0; }
table.nodes { border-collapse: collapse; font-size: 12px; margin-top: 4px; }
table.nodes td { border: none; padding: 0 8px 0 0; }
.note { color: #555; font-size: 13px; } .muted { color: #888; }
"""


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


def _communicates(edge: EdgePlan) -> bool:
    """Moves bytes forward, or backward at a price (a grad sync of an integer input costs nothing)."""
    return any(s.kind.communicates for s in edge.steps) or (edge.comm_s > 0 and bool(_moves(edge)))


def layer_rows(plan: Plan) -> list[LayerRow]:
    """The layer table's rows in program order. A parameter sits in the row of its first
    consumer, an edge in the row of its consumer, other graph inputs in a row of their own."""
    position = {n.name: i for i, n in enumerate(plan.nodes)}
    first_use: dict[str, int] = {}
    for e in plan.edges:
        first_use[e.producer] = min(first_use.get(e.producer, len(position)), position.get(e.consumer, len(position)))
    where: dict[str, tuple[str, int]] = {}  # node -> (its row, the program position that places it)
    for i, n in enumerate(plan.nodes):
        if n.kind is NodeKind.PARAMETER and first_use.get(n.name, len(position)) < len(position):
            where[n.name] = (layer_key(plan.nodes[first_use[n.name]].module), first_use[n.name])
        else:
            where[n.name] = (INPUTS_ROW, -1) if n.kind.is_input else (layer_key(n.module), i)
    starts: dict[str, int] = {}
    for row, i in where.values():
        starts[row] = min(starts.get(row, i), i)
    rows = []
    for name in sorted(starts, key=starts.__getitem__):
        nodes = tuple(n for n in plan.nodes if where[n.name][0] == name)
        edges = tuple(e for e in plan.edges
                      if where.get(e.consumer, ("", 0))[0] == name and _communicates(e))
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


# ---- HTML pieces -------------------------------------------------------------------
def chip(placement: str, suffix: str = "") -> str:
    bg = placement_colour(placement)
    return (f'<span class="chip" style="background:{bg};color:{text_colour(bg)}">'
            f"{html.escape(placement)}{html.escape(suffix)}</span>")


def _moves(edge: EdgePlan) -> tuple[Step, ...]:
    return tuple(s for s in edge.steps if s.kind.communicates or s.backward.communicates)


def _kinds(edge: EdgePlan) -> str:
    """'all_gather axis 0 (backward reduce_scatter) + slice axis 1 (backward all_gather)'."""
    return " + ".join(f"{s.kind} axis {s.axis}" + (f" (backward {s.backward})" if s.backward.communicates else "")
                      for s in _moves(edge))


def _mib(edge: EdgePlan, plan: Plan) -> float:
    """The bytes one rank puts into the edge's moving steps (each step's local input)."""
    return sum(s.before.local_nbytes(plan.mesh.shape) for s in _moves(edge) if s.before is not None) / MIB


def _comms_html(row: LayerRow, plan: Plan) -> str:
    """One line per kind of collective, dearest first, with its edges (one each: inline;
    more: behind a fold)."""
    groups: dict[str, list[EdgePlan]] = {}
    for e in row.edges:
        groups.setdefault(_kinds(e), []).append(e)
    items = []
    for kinds, edges in sorted(groups.items(), key=lambda kv: -sum(e.comm_s for e in kv[1])):
        each = [f"{html.escape(e.producer)} → {html.escape(e.consumer)}: {_mib(e, plan):.2f} MiB, "
                f"{e.comm_s * 1e3:.3f} ms" for e in edges]
        where = (f'<span class="muted">{html.escape(edges[0].producer)} → {html.escape(edges[0].consumer)}</span>'
                 if len(edges) == 1 else
                 f"<details><summary>{len(edges)} edges</summary><ul>"
                 + "".join(f'<li class="muted">{x}</li>' for x in each) + "</ul></details>")
        items.append(f"<li>{html.escape(kinds)} ×{len(edges)}: <b>{sum(_mib(e, plan) for e in edges):.2f} MiB, "
                     f"{sum(e.comm_s for e in edges) * 1e3:.3f} ms</b> {where}</li>")
    return f'<ul class="comms">{"".join(items)}</ul>' if items else '<span class="muted">none</span>'


def _row_html(row: LayerRow, plan: Plan) -> str:
    params = " ".join(f'<span class="muted">{html.escape(n)}</span>&nbsp;{chip(p)}' for n, p in row.params)
    outs = " ".join(chip(p, f" ×{k}") for p, k in row.outputs)
    nodes = "".join(f"<tr><td>{html.escape(n.name)}</td><td>{html.escape(n.op)}</td>"
                    f"<td>{' '.join(chip(str(s)) for s in n.outputs)}</td>"
                    f'<td class="num">{n.compute_s * 1e6:.2f} µs</td></tr>' for n in row.nodes)
    return (f"<tr><td><b>{html.escape(row.name)}</b><details><summary>{len(row.nodes)} nodes</summary>"
            f'<table class="nodes">{nodes}</table></details></td>'
            f"<td>{params or '<span class=muted>none</span>'}</td><td>{outs or '–'}</td>"
            f"<td>{_comms_html(row, plan)}</td>"
            f'<td class="num">{row.compute_s * 1e3:.3f}</td><td class="num">{row.comm_s * 1e3:.3f}</td></tr>')


def layers_html(plan: Plan) -> str:
    rows = layer_rows(plan)
    head = ("<tr><th>layer</th><th>parameters (placement)</th><th>op outputs (placement × count)</th>"
            "<th>collectives on edges into the layer, by kind (MiB one rank sends, predicted ms forward + "
            "backward)</th>"
            "<th>compute ms</th><th>comm ms</th></tr>")
    return (f'<table class="layers" id="layer-table">{head}{"".join(_row_html(r, plan) for r in rows)}</table>'
            f'<p class="note">{len(rows)} rows; a parameter is listed in the layer of its first use. '
            "Times are the cost model's per-rank seconds of forward and backward.</p>")


def legend_html(plans: list[Plan]) -> str:
    counts = Counter(str(s) for p in plans for n in p.nodes for s in n.outputs)
    chips = " ".join(chip(p, f" ×{k}") for p, k in counts.most_common())
    return (f'<div id="legend">{chips}</div><p class="note">Each placement has one colour in every '
            "picture (this page and autopar.tools.visualize): R replicated, S(d) split along tensor dim d, "
            "P a partial sum awaiting reduction; one letter group per mesh axis.</p>")


def _plan_sections(plan: Plan, title: str) -> str:
    return (f'<section class="memory"><h2>Memory per rank{title}</h2>{memory_svg(plan)}</section>'
            f'<section class="timeline"><h2>One step, program order{title}</h2>'
            f"{timeline_svg(plan, layer_key)}</section>"
            f'<section class="layers"><h2>Placements and collectives per layer{title}</h2>'
            f"{layers_html(plan)}</section>")


def render(plan: Plan) -> str:
    """The report as one HTML string."""
    stages = list(plan.stage_plans) if not plan.nodes and plan.stage_plans else []
    parts = [_plan_sections(s, f" (pipeline stage {k})") for k, s in enumerate(stages)] or [_plan_sections(plan, "")]
    mesh = "×".join(map(str, plan.mesh.shape))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>autopar plan: {html.escape(plan.model_name)} on mesh {mesh}</title>"
            f"<style>{CSS}</style></head><body>"
            f"<h1>{html.escape(plan.model_name)} on mesh {mesh}</h1>"
            f'<section id="summary"><h2>Summary</h2><pre class="summary">{html.escape(plan.summary())}</pre></section>'
            f'<section id="colours"><h2>Placements</h2>{legend_html(stages or [plan])}</section>'
            + "".join(parts) + "</body></html>\n")


# ---- the file ----------------------------------------------------------------------
def write_html(plan: Plan, path: str | os.PathLike) -> str:
    """Write `plan`'s report to `path` as one self-contained HTML file (atomically: a reader
    sees the old file or the new one) and return its absolute path. PlanFileError names a
    path that cannot be written and why."""
    target = _checked_path(path)
    _write_atomic(target, render(plan))
    return target


plan_report = write_html  # the public name: autopar.plan_report(plan, path)


def _checked_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise PlanFileError(f"the report path must be a str or os.PathLike, not {type(path).__name__} "
                            f"({path!r}); pass a file name such as 'plan.html'")
    target = os.path.abspath(os.fspath(path))
    if not os.fspath(path) or os.path.isdir(target):
        raise PlanFileError(f"the report path {os.fspath(path)!r} is a folder, not a file; "
                            "pass a file name such as 'plan.html' inside it")
    return target


def _write_atomic(target: str, text: str) -> None:
    """A temporary file beside `target`, renamed over it. os.open's mode 0o666 gets the
    umask as open() would, so the report is as readable as any file the user writes."""
    folder = os.path.dirname(target)
    tmp = os.path.join(folder, f".{os.path.basename(target)}.{secrets.token_hex(4)}.tmp")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise PlanFileError(f"cannot write the plan report to {target}: {e.strerror or e}; "
                            "pass a path in a folder you can write") from None
