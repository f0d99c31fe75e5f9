"""The two drawings of the HTML report (autopar/tools/report.py), as inline SVG strings.

    memory_svg(plan)              per rank: parameters | gradients + optimizer state |
                                  activations, on a scale that ends past the device's capacity
    layer_graph_svg(graph)        the layers as boxes in program order, links between them
                                  labelled with their collectives (autopar/tools/layers.py)
    timeline_svg(plan, layer_of)  one step in program order, on three lanes:

        compute         |node|node|  node  |node|          |node|...
        communication             [edge, blocking]
        hidden          [edge's hidden share]               (ends where its consumer starts)

Timeline rules: each node's bar is its compute seconds (forward and backward, as the plan
prices them), coloured by its output placement; each edge's collectives sit just before
the node that reads the edge. The plan records how much communication the cost model
hides under compute (Plan.hidden_s: gradient buckets under backward, prefetched parameter
gathers) as a total, not per edge, so that total is spread over the parameter edges in
proportion to their price: an edge's hidden share is drawn on the third lane, ending where
its consumer starts, and only the rest blocks the compute lane. The bars then end at the
predicted step, compute + communication - hidden (Plan.total_s).
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass
from math import floor, log10
from typing import Callable, Optional

from autopar.core.kinds import NodeKind
from autopar.core.plan import Plan
from autopar.cost_models.devices import PRESETS
from autopar.tools.layers import LayerBox, LayerGraph, routes
from autopar.tools.palette import CAPACITY, COMMUNICATION, MEMORY_COLOURS, placement_colour, text_colour

MIB, GIB = 2**20, 2**30
WIDTH = 1300  # px of every drawing
LABEL_W = 190  # px of the lane and row labels on the left
PLOT_W = WIDTH - LABEL_W - 20
MAX_RANK_ROWS = 16  # more ranks than this: the rest are said in words (they hold the same bytes)
HIDDEN_PATTERN = ('<defs><pattern id="hidden" width="6" height="6" patternUnits="userSpaceOnUse" '
                  'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3c9ca"/>'
                  f'<rect width="3" height="6" fill="{COMMUNICATION}"/></pattern></defs>')


def _bytes(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str, extra: str = "") -> str:
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.0):.2f}" height="{h:.2f}" fill="{fill}" {extra}>'
            f"<title>{html.escape(tip)}</title></rect>")


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "start", fill: str = "#222") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}" '
            f'font-family="system-ui, sans-serif">{html.escape(s)}</text>')


def _ticks(total: float, x0: float, scale: float, y: float, height: float, unit: float, name: str) -> str:
    """Grid lines labelled in `name` (worth `unit` each) at 1, 2 or 5 x 10^k steps, about eight."""
    if total <= 0:
        return ""
    raw = total / unit / 8
    base = 10 ** floor(log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    out, k = [], 0
    while k * step * unit <= total * 1.0001:
        x = x0 + k * step * unit * scale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + height}" stroke="#ddd"/>'
                   + _text(x, y + height + 13, f"{k * step:g} {name}", 11, "middle", "#555"))
        k += 1
    return "".join(out)


def _svg(height: float, body: str, label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
            f'viewBox="0 0 {WIDTH} {height:.0f}" role="img" aria-label="{html.escape(label)}">{body}</svg>')


# ---- memory ------------------------------------------------------------------------
def capacity_bytes(plan: Plan) -> Optional[int]:
    """The device preset's memory per rank (None: the preset names none, or the plan's
    device is not a preset)."""
    spec = PRESETS.get(plan.device.lower())
    return spec.memory_bytes if spec is not None else None


def memory_parts(plan: Plan) -> dict[str, int]:
    return {"parameters": plan.param_bytes, "gradients + optimizer state": plan.state_bytes,
            "activations": plan.activation_bytes}


def _bar(parts: dict[str, int], x0: float, y: float, h: float, scale: float, inside_labels: bool) -> str:
    out, x = [], x0
    for kind, nbytes in parts.items():
        w = nbytes * scale
        out.append(_rect(x, y, w, h, MEMORY_COLOURS[kind], f"{kind}: {_bytes(nbytes)}"))
        if inside_labels and w > 110:
            out.append(_text(x + 4, y + h - 6, f"{kind} {_bytes(nbytes)}", 11, fill="#fff"))
        x += w
    return "".join(out)


def memory_svg(plan: Plan) -> str:
    """One bar of the footprint's make-up (scaled to itself), then one bar per rank on a
    scale to the device's capacity, which a dark line marks."""
    parts, total, cap = memory_parts(plan), plan.memory_bytes, capacity_bytes(plan)
    out, y, h = [], 8, 22
    out.append(_text(LABEL_W - 8, y + 16, "make-up of one rank", anchor="end"))
    out.append(_bar(parts, LABEL_W, y, h, PLOT_W / max(total, 1), True))
    y += h + 26
    end = max(total, cap or 0) * 1.04 or 1
    scale = PLOT_W / end
    top = y
    ranks = min(plan.mesh.size, MAX_RANK_ROWS)
    for r in range(ranks):
        out.append(_text(LABEL_W - 8, y + 14, f"rank {r} {plan.mesh.coords(r)}", anchor="end"))
        out.append(_bar(parts, LABEL_W, y, 18, scale, False))
        share = f" ({total / cap:.1%} of {_bytes(cap)})" if cap else ""
        out.append(_text(LABEL_W + total * scale + 6, y + 14, f"{_bytes(total)}{share}", 11))
        y += 22
    if cap:
        x = LABEL_W + cap * scale
        out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{y + 2}" stroke="{CAPACITY}" '
                   f'stroke-width="2" stroke-dasharray="6 3"/>')
        out.append(_text(x - 4, top - 9, f"{plan.device} capacity {_bytes(cap)}", 11, "end"))
    out.append(_ticks(end, LABEL_W, scale, top - 4, y - top + 4, *((GIB, "GiB") if end >= GIB else (MIB, "MiB"))))
    if plan.mesh.size > ranks:
        out.append(_text(LABEL_W, y + 30, f"ranks {ranks}..{plan.mesh.size - 1}: the same bytes", 11))
        y += 16
    y += 40
    legend = [f'<rect x="{LABEL_W + 300 * i}" y="{y - 11}" width="12" height="12" fill="{MEMORY_COLOURS[k]}"/>'
              + _text(LABEL_W + 300 * i + 16, y, f"{k} {_bytes(v)}", 11) for i, (k, v) in enumerate(parts.items())]
    note = "" if cap else _text(LABEL_W, y + 18, f"no capacity known for device {plan.device!r}", 11, fill="#a00")
    return _svg(y + 26, "".join(out + legend) + note, "memory per rank")


# ---- timeline ----------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    lane: int  # 0 compute, 1 communication (blocking), 2 hidden under compute
    start_s: float
    length_s: float
    fill: str
    tip: str
    node: str = ""  # the node a compute bar runs


def hidden_fraction(plan: Plan) -> tuple[float, frozenset[int]]:
    """(share of each parameter edge's price drawn as hidden, the indices of those edges);
    the shares add up to Plan.hidden_s where the parameter edges cost that much."""
    params = {n.name for n in plan.nodes if n.kind is NodeKind.PARAMETER}
    chosen = [i for i, e in enumerate(plan.edges) if e.producer in params and e.comm_s > 0]
    if not chosen:
        chosen = [i for i, e in enumerate(plan.edges) if e.comm_s > 0]
    pool = sum(plan.edges[i].comm_s for i in chosen)
    return (min(1.0, plan.hidden_s / pool) if pool > 0 else 0.0), frozenset(chosen)


def timeline_segments(plan: Plan) -> list[Segment]:
    """The step's bars in program order (see the module docstring)."""
    fraction, overlapped = hidden_fraction(plan)
    into: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(plan.edges):
        if e.comm_s > 0:
            into[e.consumer].append(i)
    out, clock = [], 0.0
    for n in plan.nodes:
        back = clock  # hidden shares end where this node starts, laid back to back
        for i in into.get(n.name, ()):
            e = plan.edges[i]
            tip = f"{e.producer} -> {e.consumer}: {', '.join(map(str, e.steps))}, {e.comm_s * 1e3:.4f} ms"
            hidden = e.comm_s * fraction if i in overlapped else 0.0
            if hidden > 0:
                out.append(Segment(2, max(back - hidden, 0.0), hidden, "url(#hidden)", f"hidden: {tip}"))
                back -= hidden
            if e.comm_s - hidden > 0:
                out.append(Segment(1, clock, e.comm_s - hidden, COMMUNICATION, tip))
                clock += e.comm_s - hidden
        if n.compute_s > 0:
            label = ",".join(map(str, n.outputs)) or "-"
            tip = f"{n.name} ({n.op}{', ' + n.module if n.module else ''}) {label}: {n.compute_s * 1e6:.2f} us"
            out.append(Segment(0, clock, n.compute_s, placement_colour(label), tip, n.name))
            clock += n.compute_s
    return out


def _layer_marks(plan: Plan, layer_of: Callable[[str], str], starts: dict[str, float], x0: float,
                 scale: float, y: float, height: float) -> str:
    """A faint line where each layer's first op starts, named where there is room."""
    out, last_x = [], -1e9
    seen: set[str] = set()
    for n in plan.nodes:
        key = layer_of(n.module)
        if n.kind.is_input or key in seen or n.name not in starts:
            continue
        seen.add(key)
        x = x0 + starts[n.name] * scale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + height}" stroke="#999" stroke-dasharray="2 2"/>')
        if x - last_x > 90:
            out.append(_text(x + 2, y - 3, key, 10, fill="#555"))
            last_x = x
    return "".join(out)


def timeline_svg(plan: Plan, layer_of: Callable[[str], str]) -> str:
    segments = timeline_segments(plan)
    end = max((s.start_s + s.length_s for s in segments), default=0.0)
    scale = PLOT_W / end if end > 0 else 0.0
    lanes = ("compute", "communication (blocking)", "hidden under compute")
    top, lane_h, gap = 22, 26, 8
    ys = [top + k * (lane_h + gap) for k in range(3)]
    out = [HIDDEN_PATTERN]
    for k, name in enumerate(lanes):
        out.append(_text(LABEL_W - 8, ys[k] + 17, name, anchor="end"))
        out.append(f'<rect x="{LABEL_W}" y="{ys[k]}" width="{PLOT_W}" height="{lane_h}" fill="#f7f7f7"/>')
    bottom = ys[-1] + lane_h
    out.append(_ticks(end, LABEL_W, scale, top, bottom - top, 1e-3, "ms"))
    starts = {s.node: s.start_s for s in segments if s.lane == 0}
    out.append(_layer_marks(plan, layer_of, starts, LABEL_W, scale, top, bottom - top))
    for s in segments:
        out.append(_rect(LABEL_W + s.start_s * scale, ys[s.lane] + 2, s.length_s * scale, lane_h - 4, s.fill, s.tip))
    out.append(f'<line x1="{LABEL_W + end * scale:.1f}" y1="{top - 4}" x2="{LABEL_W + end * scale:.1f}" '
               f'y2="{bottom + 4}" stroke="{CAPACITY}" stroke-width="2"/>')
    note = (f"every rank of the {plan.mesh.size} runs this program (SPMD; the plan prices one rank): step "
            f"{plan.total_s * 1e3:.3f} ms = compute {plan.compute_s * 1e3:.3f} + communication "
            f"{plan.comm_s * 1e3:.3f} - hidden {plan.hidden_s * 1e3:.3f}")
    out.append(_text(LABEL_W, bottom + 34, note, 12))
    out.append(_text(LABEL_W, bottom + 52, "compute bars in their output placement's colour; hatched: the cost "
                     "model's hidden seconds, spread over the parameter edges by price; hover a bar for its node "
                     "or edge", 11, fill="#555"))
    return _svg(bottom + 62, "".join(out), "timeline of one step")


# ---- layer graph -------------------------------------------------------------------
BOX_X, BOX_W, BOX_H, BOX_GAP = 24, 380, 36, 30  # px: the column of layer boxes
ARC_STEP = 16  # px between the lanes of links that skip boxes


def _box(box: LayerBox, y: float) -> str:
    fill = placement_colour(box.placement) if box.placement else "#ffffff"
    ink = text_colour(fill)
    title = box.name + (f" x{box.repeats}" if box.repeats > 1 else "")
    detail = f"compute {box.compute_s * 1e3:.3f} ms" + (f", inside {box.inner_s * 1e3:.3f} ms comm" if box.inner else "")
    tip = "\n".join([f"{title}: output placement {box.placement or '-'}; {detail}"]
                    + [f"inside: {k} x{c}" for k, c in box.inner] + [f"row {r.name}" for r in box.rows[:8]]
                    + ([f"... {box.repeats - 8} more rows"] if box.repeats > 8 else []))
    return (f'<g class="layer"><title>{html.escape(tip)}</title>'
            f'<rect x="{BOX_X}" y="{y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="5" fill="{fill}" stroke="#555"/>'
            + _text(BOX_X + 8, y + 15, title, 12, fill=ink) + _text(BOX_X + 8, y + 30, detail, 10, fill=ink) + "</g>")


def layer_graph_svg(graph: LayerGraph) -> str:
    """The boxes in a column in program order; a link between neighbours is an arrow between
    them, one that skips boxes an arc on the right. Links that move bytes are red and
    labelled with their collectives; the rest grey."""
    top = [10 + i * (BOX_H + BOX_GAP) for i in range(len(graph.boxes))]
    out = ['<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" '
           'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#666"/></marker></defs>']
    out += [_box(b, y) for b, y in zip(graph.boxes, top)]
    right = BOX_X + BOX_W
    for route in routes(graph):
        link = route.link
        colour, width = (COMMUNICATION, 2.0) if link.communicates else ("#999", 1.0)
        tip = f"{link.source} -> {link.target}: {link.edges} edges" + (
            f"; {link.label(most=len(link.collectives))}" if link.communicates else ", no collective")
        if route.lane == 0:  # neighbours: straight down the column
            x, y0, y1 = BOX_X + BOX_W / 2, top[route.source] + BOX_H, top[route.target]
            out.append(f'<g class="link"><title>{html.escape(tip)}</title><line x1="{x}" y1="{y0}" x2="{x}" '
                       f'y2="{y1 - 1}" stroke="{colour}" stroke-width="{width}" marker-end="url(#arrow)"/>'
                       + (_text(x + 8, (y0 + y1) / 2 + 4, link.label(), 11, fill=COMMUNICATION)
                          if link.communicates else "") + "</g>")
            continue
        x = right + 12 + route.lane * ARC_STEP
        y0, y1 = top[route.source] + BOX_H / 2, top[route.target] + BOX_H / 2
        out.append(f'<g class="link"><title>{html.escape(tip)}</title><path d="M{right},{y0} H{x} V{y1} H{right + 2}" '
                   f'fill="none" stroke="{colour}" stroke-width="{width}" marker-end="url(#arrow)"/>'
                   + (_text(x + 4, (y0 + y1) / 2, link.label(), 11, fill=COMMUNICATION)
                      if link.communicates else "") + "</g>")
    height = 20 + len(graph.boxes) * (BOX_H + BOX_GAP)
    return _svg(height, "".join(out), "layer graph")
