"""A plan as one self-contained HTML page: inline CSS and SVG, no script, no network.

    write_html(plan, "plan.html")      # also autopar.plan_report(plan, "plan.html")

The page, top to bottom:
    summary     plan.summary()'s lines
    colours     every placement the plan uses, in its fixed colour (autopar/tools/palette.py)
    memory      per rank: parameters, gradients + optimizer state, activations, against
                the device preset's capacity (autopar/tools/report_svg.py)
    layer graph one box per layer (identical consecutive blocks as one box), links
                between layers labelled with their collectives (autopar/tools/layers.py)
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
import secrets
from collections import Counter

from autopar.core.errors import PlanFileError
from autopar.core.plan import Plan
from autopar.core.plan_parts import EdgePlan
from autopar.tools.layers import LayerRow, edge_mib, kinds, layer_graph, layer_key, layer_rows
from autopar.tools.palette import placement_colour, text_colour
from autopar.tools.report_svg import layer_graph_svg, memory_svg, timeline_svg

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


# ---- HTML pieces -------------------------------------------------------------------
def chip(placement: str, suffix: str = "") -> str:
    bg = placement_colour(placement)
    return (f'<span class="chip" style="background:{bg};color:{text_colour(bg)}">'
            f"{html.escape(placement)}{html.escape(suffix)}</span>")





def _comms_html(row: LayerRow, plan: Plan) -> str:
    """One line per kind of collective, dearest first, with its edges (one each: inline;
    more: behind a fold)."""
    groups: dict[str, list[EdgePlan]] = {}
    for e in row.edges:
        groups.setdefault(kinds(e), []).append(e)
    items = []
    for label, edges in sorted(groups.items(), key=lambda kv: -sum(e.comm_s for e in kv[1])):
        each = [f"{html.escape(e.producer)} → {html.escape(e.consumer)}: {edge_mib(e, plan):.2f} MiB, "
                f"{e.comm_s * 1e3:.3f} ms" for e in edges]
        where = (f'<span class="muted">{html.escape(edges[0].producer)} → {html.escape(edges[0].consumer)}</span>'
                 if len(edges) == 1 else
                 f"<details><summary>{len(edges)} edges</summary><ul>"
                 + "".join(f'<li class="muted">{x}</li>' for x in each) + "</ul></details>")
        items.append(f"<li>{html.escape(label)} ×{len(edges)}: <b>{sum(edge_mib(e, plan) for e in edges):.2f} MiB, "
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
            f'<section class="layer-graph"><h2>Layers and the collectives between them{title}</h2>'
            f"{layer_graph_svg(layer_graph(plan))}<p class=\"note\">Each box a layer in program order (identical "
            "consecutive blocks drawn as one box, x its count), coloured by the placement most of its op outputs "
            "have; red links carry collectives (one rank's MiB, predicted ms forward + backward); hover for "
            "details.</p></section>"
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
