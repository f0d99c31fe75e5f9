"""Pictures of a Plan: matplotlib figures, returned for pyplot or a notebook to show (the
backend stays the caller's); networkx lays out the graph.

    visualize(plan)                 -> {"tensors", "graph", "layers", "costs"}: Figure each
    tensor_blocks(plan, names)      which block of each tensor every device of the mesh holds
    graph_figure(plan)              the op graph coloured by output placement, collectives in red
    layer_graph_figure(plan)        the same at the level of layers: a box per layer (identical
                                    consecutive blocks as one), links labelled with their collectives
    cost_figure(plan)               per-layer compute vs communication; per-rank memory breakdown

Every placement has the colour autopar/tools/palette.py gives it, the one the HTML report
(autopar/tools/report.py) uses too, so a placement looks the same in every picture.
"""

from __future__ import annotations

from typing import Optional, Sequence

import networkx as nx

from autopar.core.kinds import NodeKind
from autopar.core.placement import Partial, Shard, Spec
from autopar.core.plan import Plan
from autopar.tools.layers import layer_graph, layer_key, routes
from autopar.tools.palette import COMMUNICATION, COMPUTE, MEMORY_COLOURS, placement_colour, text_colour


def _plt():
    """matplotlib.pyplot, imported when a picture is first drawn (matplotlib is the
    optional [viz] extra). The backend is the user's: a notebook's inline backend shows
    the figures, a script saves or shows them, and one without a display gets matplotlib's
    own headless default. A library never switches it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("autopar.tools.visualize draws with matplotlib: pip install 'autopar[viz]'") from None
    return plt


def mesh_label(plan: Plan) -> str:
    """The mesh shape with the link each axis was priced with (Plan.links), e.g.
    "(2, 4) [axis 0 inter-node ib-400g, axis 1 intra-node nvlink4]": on a picture of a plan
    for several nodes, which axis crosses them is what explains its placements."""
    if not plan.links:
        return str(plan.mesh.shape)
    axes = ", ".join(f"axis {a} {x.kind.value}-node {x.link.name}".rstrip() for a, x in enumerate(plan.links))
    return f"{plan.mesh.shape} [{axes}]"


def _block(spec: Spec, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> tuple[float, float, float, float]:
    """(row0, row1, col0, col1) fractions of the tensor seen as [dim 0, the rest] that
    the device at `coords` holds."""
    rows, cols = [0.0, 1.0], [0.0, 1.0]
    for axis, p in enumerate(spec.placements):
        if not isinstance(p, Shard):
            continue
        n, c = mesh_shape[axis], coords[axis]
        span = rows if p.dim == 0 else cols
        width = (span[1] - span[0]) / n
        span[0], span[1] = span[0] + c * width, span[0] + (c + 1) * width
    return rows[0], rows[1], cols[0], cols[1]


def _default_tensors(plan: Plan, limit: int = 6) -> list[str]:
    params = [n for n in plan.nodes if n.kind is NodeKind.PARAMETER and n.outputs]
    params.sort(key=lambda n: -n.outputs[0].meta.nbytes)
    acts = [n for n in plan.nodes if n.kind in (NodeKind.OP, NodeKind.GETITEM) and n.outputs
            and not n.outputs[0].is_replicated()]
    return [n.name for n in params[: limit - 2]] + [n.name for n in acts[:2]]


def tensor_blocks(plan: Plan, names: Optional[Sequence[str]] = None):
    """One row per tensor, one column per device: the shaded block is what that device
    holds (hatched where it holds a partial sum)."""
    plt = _plt()
    from matplotlib.patches import Rectangle
    names = list(names) if names is not None else _default_tensors(plan)
    mesh = plan.mesh
    fig, axes = plt.subplots(len(names), mesh.size, figsize=(1.3 * mesh.size + 1.5, 1.25 * len(names) + 0.6),
                             squeeze=False)
    for i, name in enumerate(names):
        spec = plan.node(name).outputs[0]
        for r in range(mesh.size):
            ax = axes[i][r]
            coords = mesh.coords(r)
            r0, r1, c0, c1 = _block(spec, mesh.shape, coords)
            ax.add_patch(Rectangle((0, 0), 1, 1, fill=False, lw=0.8))
            partial = any(isinstance(p, Partial) for p in spec.placements)
            ax.add_patch(Rectangle((c0, 1 - r1), c1 - c0, r1 - r0, color=placement_colour(str(spec)), alpha=0.8,
                                   hatch="//" if partial else None))
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(f"rank {r}\n{coords}", fontsize=7)
        axes[i][0].set_ylabel(f"{name}\n{spec} {list(spec.meta.shape)}", fontsize=7, rotation=0, ha="right",
                              va="center")
    fig.suptitle(f"{plan.model_name} on mesh {mesh_label(plan)}: which block each device holds", fontsize=9)
    fig.tight_layout()
    return fig


def graph_figure(plan: Plan, max_nodes: int = 400):
    """The op graph laid out by topological generation, nodes coloured by output
    placement, edges that carry a collective drawn thick and red."""
    plt = _plt()
    g = nx.DiGraph()
    for n in plan.nodes[:max_nodes]:
        g.add_node(n.name, placement=",".join(map(str, n.outputs)) or "-")
    comm_edges = []
    for e in plan.edges:
        if e.producer in g and e.consumer in g:
            g.add_edge(e.producer, e.consumer)
            if any(s.kind.communicates for s in e.steps):
                comm_edges.append((e.producer, e.consumer))
    for layer, nodes in enumerate(nx.topological_generations(g)):
        for name in nodes:
            g.nodes[name]["layer"] = layer
    pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal")
    pos = {k: (x, -y) for k, (x, y) in pos.items()}  # inputs on top
    labels = sorted({d["placement"] for _, d in g.nodes(data=True)})
    colour = {p: placement_colour(p) for p in labels}
    fig, ax = plt.subplots(figsize=(11, 8))
    nx.draw_networkx_edges(g, pos, ax=ax, alpha=0.25, arrows=False, width=0.6)
    nx.draw_networkx_edges(g, pos, edgelist=comm_edges, ax=ax, edge_color=COMMUNICATION, width=2.0, arrows=False)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_size=28,
                           node_color=[colour[g.nodes[n]["placement"]] for n in g.nodes])
    for p in labels[:20]:
        ax.scatter([], [], color=colour[p], label=p, s=20)
    ax.plot([], [], color=COMMUNICATION, lw=2, label="collective")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="output placement", title_fontsize=7)
    ax.set_title(f"{plan.model_name} on mesh {mesh_label(plan)}: {len(comm_edges)} edges with collectives",
                 fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    return fig


def layer_graph_figure(plan: Plan, collapse: bool = True):
    """The layer graph (autopar/tools/layers.py) as the HTML report draws it: boxes in a
    column in program order, an arrow between neighbours, an arc on the right for a link
    that skips boxes; links with collectives red and labelled."""
    plt = _plt()
    graph = layer_graph(plan, collapse)
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.62 * len(graph.boxes)))
    for i, b in enumerate(graph.boxes):
        fill = placement_colour(b.placement) if b.placement else "#ffffff"
        ax.add_patch(plt.Rectangle((0, -i - 0.35), 4, 0.7, facecolor=fill, edgecolor="#555"))
        name = b.name + (f" x{b.repeats}" if b.repeats > 1 else "")
        inner = f", inside {b.inner_s * 1e3:.3f} ms comm" if b.inner else ""
        ax.text(0.08, -i, f"{name}\ncompute {b.compute_s * 1e3:.3f} ms{inner}", va="center", fontsize=7,
                color=text_colour(fill))
    lanes = 0
    for route in routes(graph):
        link, a, c = route.link, route.source, route.target
        colour, width = (COMMUNICATION, 1.8) if link.communicates else ("#999999", 0.8)
        label = link.label() if link.communicates else ""
        if route.lane == 0:
            ax.annotate("", xy=(2, -c + 0.35), xytext=(2, -a - 0.35),
                        arrowprops=dict(arrowstyle="->", color=colour, lw=width))
            if label:
                ax.text(2.08, -a - 0.5, label, fontsize=6, color=COMMUNICATION, va="center")
            continue
        lanes = max(lanes, route.lane)
        x = 4.15 + 0.12 * route.lane
        ax.plot([4, x, x], [-a, -a, -c], color=colour, lw=width)
        ax.annotate("", xy=(4, -c), xytext=(x, -c), arrowprops=dict(arrowstyle="->", color=colour, lw=width))
        if label:
            ax.text(x + 0.05, -(a + c) / 2, label, fontsize=6, color=COMMUNICATION, va="center")
    ax.set_xlim(-0.1, 4.6 + 0.12 * lanes + 3.5)
    ax.set_ylim(-len(graph.boxes) + 0.4, 0.6)
    ax.set_title(f"{plan.model_name} on mesh {mesh_label(plan)}: layers and the collectives between them",
                 fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    return fig


def memory_breakdown(plan: Plan) -> dict[str, int]:
    """Per-rank bytes: parameters, gradients and AdamW state (training), activations."""
    out = {"parameters": plan.param_bytes}
    if plan.state_bytes:
        out["gradients + optimizer state"] = plan.state_bytes
    out["activations"] = plan.activation_bytes
    return out


def cost_figure(plan: Plan):
    plt = _plt()
    layers: dict[str, list[float]] = {}
    module = {n.name: n.module for n in plan.nodes}
    for n in plan.nodes:
        layers.setdefault(layer_key(n.module), [0.0, 0.0])[0] += n.compute_s
    for e in plan.edges:
        layers.setdefault(layer_key(module.get(e.consumer, "")), [0.0, 0.0])[1] += e.comm_s
    names = list(layers)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [layers[k][0] * 1e3 for k in names], width=0.4, label="compute", color=COMPUTE)
    ax1.bar([i + 0.2 for i in x], [layers[k][1] * 1e3 for k in names], width=0.4, label="communication",
            color=COMMUNICATION)
    ax1.set_xticks(list(x))
    ax1.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax1.set_ylabel("predicted ms per step, per rank")
    ax1.set_title(f"{plan.model_name}: per-layer compute vs communication", fontsize=9)
    ax1.legend(fontsize=8)
    mem = memory_breakdown(plan)
    bottom = [0.0] * plan.mesh.size
    for kind, nbytes in mem.items():
        vals = [nbytes / 2**20] * plan.mesh.size
        ax2.bar(range(plan.mesh.size), vals, bottom=bottom, label=kind, color=MEMORY_COLOURS[kind])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xlabel("rank")
    ax2.set_ylabel("MiB")
    ax2.set_title("memory per rank", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def visualize(plan: Plan, path_prefix: Optional[str] = None) -> dict:
    """Every picture; with `path_prefix`, also saved as <prefix>_<name>.png."""
    figs = {"tensors": tensor_blocks(plan), "graph": graph_figure(plan), "layers": layer_graph_figure(plan),
            "costs": cost_figure(plan)}
    if path_prefix:
        for name, fig in figs.items():
            fig.savefig(f"{path_prefix}_{name}.png", dpi=110, bbox_inches="tight")
    return figs
