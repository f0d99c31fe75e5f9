"""The HTML report of a plan (autopar/tools/report.py) and the one colour per placement
(autopar/tools/palette.py) that it shares with autopar/tools/visualize.py.

One offline plan (GPT-2's shapes on the meta device, two layers, a (2, 2) mesh, the h100
preset, training) is written as a report; the page is read back with html.parser, and
drawn by a headless chromium where one is installed (.ci/run installs it; the browser test
skips without it).
"""

from __future__ import annotations

import dataclasses
import html
import html.parser
import os
import shutil
import subprocess

import pytest

import autopar
from autopar.core.errors import PlanFileError
from autopar.tools import zoo
from autopar.tools.palette import COMMUNICATION, REPLICATED, canonical, placement_colour
from autopar.tools.layers import layer_graph, row_of
from autopar.tools.report import layer_key, layer_rows, render, write_html
from autopar.tools.report_svg import capacity_bytes, timeline_segments

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def plan():
    # four blocks: the layer graph draws identical consecutive ones as one box
    model, args, kwargs = zoo.build("gpt2-small", batch=8, seq=512, training=True, device="meta", n_layer=4)
    return autopar.plan(model, args, kwargs, mesh=(2, 2), device="h100", training=True)


@pytest.fixture(scope="module")
def page(plan, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "plan.html"
    assert write_html(plan, path) == str(path)
    return path


class Page(html.parser.HTMLParser):
    """Headings, the summary, the layer table's rows (cells as text), tags seen and text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.headings: list[str] = []
        self.summary = ""
        self.rows: list[list[str]] = []
        self.row_names: list[str] = []  # the bold name that opens each row's first cell
        self.text: list[str] = []
        self._open: list[str] = []
        self._in_table = self._in_summary = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        self._open.append(tag)
        if tag == "table" and a.get("id") == "layer-table":
            self._in_table = True
        elif tag == "pre" and a.get("class") == "summary":
            self._in_summary = True
        elif tag == "tr" and self._in_table and self._open.count("table") == 1:
            self.rows.append([])
        elif tag == "td" and self._in_table and self._open.count("table") == 1:
            self.rows[-1].append("")

    def handle_endtag(self, tag):
        while self._open and self._open.pop() != tag:
            pass
        if tag == "table" and "table" not in self._open:
            self._in_table = False
        if tag == "pre":
            self._in_summary = False

    def handle_data(self, data):
        self.text.append(data)
        if self._open and self._open[-1] == "h2":
            self.headings.append(data)
        if self._in_summary:
            self.summary += data
        if self._in_table and self.rows and self.rows[-1] and self._open.count("table") == 1:
            self.rows[-1][-1] += data
            if self._open[-1] == "b" and len(self.rows[-1]) == 1:
                self.row_names.append(data)


def _parsed(path) -> Page:
    p = Page()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def test_the_page_has_every_section(plan, page):
    p = _parsed(page)
    assert p.headings == ["Summary", "Placements", "Memory per rank", "Layers and the collectives between them",
                          "One step, program order", "Placements and collectives per layer"]
    assert p.summary == plan.summary()
    assert p.tags.count("svg") == 3 and "script" not in p.tags
    text = page.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    assert "h100 capacity 80.0 GiB" in "".join(p.text)


def test_the_layer_table_has_a_row_per_layer_with_its_collectives(plan, page):
    p = _parsed(page)
    rows, names = [r for r in p.rows if r], p.row_names  # the header row has <th>, no <td>
    assert names == [r.name for r in layer_rows(plan)]
    assert {"transformer.h.0", "transformer.h.1", "lm_head"} <= set(names)
    block = rows[names.index("transformer.h.0")]
    assert "attn_c_attn_weight" in block[1]  # the parameters column: transformer.h.0's own
    shown = sum(len(r.edges) for r in layer_rows(plan))
    assert shown and sum(r[3].count("→") for r in rows) == shown  # "producer → consumer: x MiB, y ms" each
    assert "all_reduce axis 1" in "".join(r[3] for r in rows)  # gpt2's Megatron-style all-reduce over axis 1


def test_rows_hold_every_node_once_and_every_priced_edge(plan):
    rows = layer_rows(plan)
    names = [n.name for r in rows for n in r.nodes]
    assert sorted(names) == sorted(n.name for n in plan.nodes)
    assert sum(r.compute_s for r in rows) == pytest.approx(plan.compute_s)
    assert sum(r.comm_s for r in rows) == pytest.approx(plan.comm_s)
    assert layer_key("transformer.h.11.mlp.c_fc") == "transformer.h.11"
    assert layer_key("model.embed_tokens") == "model.embed_tokens" and layer_key("lm_head") == "lm_head"


def test_the_layer_graph_holds_every_edge_once_inside_a_box_or_on_a_link(plan):
    rows = layer_rows(plan)
    for collapse in (False, True):
        graph = layer_graph(plan, collapse)
        assert [r.name for b in graph.boxes for r in b.rows] == [r.name for r in rows]  # program order kept
        box_of = _box_of(graph, plan)
        inside = sum(box_of[e.producer] == box_of[e.consumer] for e in plan.edges)
        assert inside + sum(k.edges for k in graph.links) == len(plan.edges)
        assert sum(b.inner_s for b in graph.boxes) + sum(k.comm_s for k in graph.links) == pytest.approx(plan.comm_s)
        assert sum(b.compute_s for b in graph.boxes) == pytest.approx(plan.compute_s)
        assert all(k.source != k.target for k in graph.links)
    flat, runs = layer_graph(plan, collapse=False), layer_graph(plan).boxes
    assert all(b.repeats == 1 for b in flat.boxes) and len(flat.boxes) == len(rows)
    # three of the four blocks at least: the first is fed by the embeddings, the last feeds ln_f,
    # and either may reshard what it is fed or feeds unlike the blocks between
    run = next(b for b in runs if b.repeats > 1)
    assert run.name.startswith("transformer.h.") and run.repeats >= 3
    numbers = [int(r.name.rsplit(".", 1)[1]) for r in run.rows]
    assert numbers == list(range(numbers[0], numbers[0] + run.repeats))
    assert all(r.params == run.rows[0].params and r.outputs == run.rows[0].outputs for r in run.rows)
    red = [k for k in flat.links if k.communicates]  # the last block's output all-reduced into ln_f
    assert red and all(" x" in k.label() and "MiB" in k.label() for k in red)


def _box_of(graph, plan):
    box = {r.name: b.name for b in graph.boxes for r in b.rows}
    return {node: box[row] for node, row in row_of(plan).items()}


def test_the_page_draws_a_box_per_layer_and_labels_collective_links(plan, page):
    text = page.read_text()
    graph = layer_graph(plan)
    assert text.count('<g class="layer">') == len(graph.boxes)
    assert text.count('<g class="link">') == len(graph.links)
    assert all(f">{html.escape(k.label())}<" in text for k in graph.links if k.communicates)


def test_the_timeline_ends_at_the_predicted_step(plan):
    segments = timeline_segments(plan)
    assert max(s.start_s + s.length_s for s in segments) == pytest.approx(plan.total_s, rel=1e-6)
    assert sum(s.length_s for s in segments if s.lane == 0) == pytest.approx(plan.compute_s)
    assert sum(s.length_s for s in segments if s.lane == 2) == pytest.approx(plan.hidden_s)
    assert plan.hidden_s > 0  # the h100 preset hides gradient buckets under backward
    assert capacity_bytes(plan) == 80 * 2**30


def test_one_colour_per_placement():
    assert placement_colour("S(0)R") == "#1f77b4" == placement_colour("S(0)") == placement_colour("S(0/64)R")
    assert placement_colour("PR") == placement_colour("P(avg)R") == placement_colour("P")
    assert {placement_colour(x) for x in ("R", "RR", "RRR", "")} == {REPLICATED}
    assert placement_colour("S(0)R") != placement_colour("RS(0)") != placement_colour("S(0)S(1)")
    odd = placement_colour("S(5)S(4)P")
    assert odd == placement_colour("S(5)S(4)P") and len(odd) == 7 and odd.startswith("#")
    assert canonical("S(0/64)P(max),RR") == "S(0)P"


def test_visualize_draws_with_the_same_colours(plan):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex
    from autopar.tools.visualize import graph_figure
    fig = graph_figure(plan)
    legend = fig.axes[0].get_legend()
    drawn = {t.get_text(): to_hex(h.get_facecolor()[0]) for t, h in zip(legend.get_texts(), legend.legend_handles)
             if t.get_text() != "collective"}
    assert drawn and all(colour == placement_colour(label) for label, colour in drawn.items())
    import matplotlib.pyplot as plt
    plt.close(fig)


@pytest.mark.parametrize("bad", ["folder", "under_a_file", "not_a_path"])
def test_a_bad_path_is_a_plan_file_error(plan, tmp_path, bad):
    (tmp_path / "a_file").write_text("x")
    path = {"folder": tmp_path, "under_a_file": tmp_path / "a_file" / "plan.html", "not_a_path": 42}[bad]
    with pytest.raises(PlanFileError, match="report"):
        write_html(plan, path)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # no temporary file left behind


def test_a_report_replaces_the_old_file_whole(plan, tmp_path):
    path = tmp_path / "deep" / "plan.html"
    path.parent.mkdir()
    path.write_text("old")
    write_html(plan, path)
    assert path.read_text().startswith("<!DOCTYPE html>") and os.listdir(path.parent) == ["plan.html"]


def _png_colours(path) -> set[tuple[int, ...]]:
    from PIL import Image  # pillow, in the [dev] extra
    with Image.open(path) as im:
        return {c for _, c in im.convert("RGB").getcolors(maxcolors=1 << 20)}


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium; .ci/run tries)")
def test_a_browser_draws_the_page(page, tmp_path):
    pytest.importorskip("PIL")
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1400,2000",
                    f"file://{page}"], check=True, capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 30_000
    colours = _png_colours(shot)
    assert len(colours) > 50
    wanted = {COMMUNICATION, placement_colour("RR")}  # the timeline's collectives; replicated chips and bars
    assert {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in wanted} <= colours


def test_a_pipelined_plan_shows_each_stage_and_a_device_without_capacity_says_so(plan):
    staged = dataclasses.replace(plan, nodes=(), edges=(), stage_plans=(plan, plan))
    page = render(staged)
    assert page.count("<svg") == 6 and "(pipeline stage 1)" in page
    cpu = dataclasses.replace(plan, device="cpu")
    assert capacity_bytes(cpu) is None and "no capacity known for device &#x27;cpu&#x27;" in render(cpu)
