"""Hierarchical meshes: which mesh axes stay inside a node, the link each is priced with,
where the solver puts tensor parallelism when the inter-node link is slow, and a run of
two torchrun agents on this machine as two nodes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

import autopar
from autopar import Link, LinkKind
from autopar.core.errors import MeshError, OptionsError, PlanFileError
from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh, check_node_layout
from autopar.core.plan import Plan
from autopar.cost_models.devices import preset
from autopar.cost_models.model import CostModel
from autopar.cost_models.profile import Profile
from autopar.passes.plan.planning import plan_traced, trace_for_planning
from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
I, X = LinkKind.INTRA, LinkKind.INTER


# ---- which axes cross nodes (ranks node-major, mesh row-major) ------------------------------
@pytest.mark.parametrize("shape, nodes, kinds", [
    ((2, 4), 1, (I, I)),  # one node: every axis inside it (the old pricing called axis 0 inter-node)
    ((2, 4), 2, (X, I)),  # axis 1 groups {0..3} {4..7}; axis 0 groups {0,4} ..
    ((4, 2), 2, (X, I)),  # axis 0 groups {0,2,4,6}: partly inside a node, so crossing
    ((3, 4), 2, (X, X)),  # axis 1 group {4,5,6,7} straddles ranks 0-5 | 6-11
    ((8,), 1, (I,)), ((8,), 2, (X,)), ((8,), 8, (X,)),
    ((2, 2, 2), 2, (X, I, I)), ((2, 2, 2), 4, (X, X, I)), ((2, 4), 8, (X, X)),
    ((1, 8), 2, (I, X)),  # a size-1 axis has one-rank groups: never crosses
])
def test_axis_link_kinds(shape, nodes, kinds):
    assert Mesh(shape).link_kinds(nodes) == kinds


def test_single_node_prices_every_axis_with_the_intra_node_link():
    h100 = preset("h100")
    one = CostModel.analytic("h100", (2, 4))
    assert [one.link(a) for a in (0, 1)] == [h100.intra_link, h100.intra_link]
    two = CostModel.analytic("h100", (2, 4), nodes=2)
    assert [two.link(a) for a in (0, 1)] == [h100.inter_link, h100.intra_link]
    slow = Link(1e-3, 1e-8, "slow")
    assert preset("h100").axis_links((4, 2), 2, {X: slow}) == (slow, h100.intra_link)


# ---- bad input -------------------------------------------------------------------------------
def test_bad_node_layouts_are_refused_with_the_value_and_the_fix():
    with pytest.raises(MeshError, match=r"nodes=3 does not divide the 8 ranks.*\[1, 2, 4, 8\]"):
        Mesh((2, 4)).link_kinds(3)
    with pytest.raises(MeshError, match=r"nodes=3 does not divide"):
        autopar.plan(models.build("mlp"), models.inputs("mlp")[0], mesh=(2, 4), nodes=3)
    with pytest.raises(MeshError, match=r"nodes=2 puts 4 ranks on each node.*runs 2 on this one.*pass nodes=4"):
        check_node_layout(Mesh((2, 4)), 2, 8, ranks_on_this_node=2)
    with pytest.raises(MeshError, match=r"mesh \(2, 4\) has 8 devices but the process group has 4"):
        check_node_layout(Mesh((2, 4)), 2, 4)
    assert check_node_layout(Mesh((2, 4)), 2, 8, ranks_on_this_node=4) == 4
    with pytest.raises(OptionsError, match=r"Options.nodes=0 is not a positive int"):
        autopar.Options(nodes=0)
    with pytest.raises(OptionsError, match=r"Options.links has key 'fast'.*LinkKind.INTRA"):
        autopar.Options(links={"fast": Link(1e-6, 1e-9)})
    with pytest.raises(OptionsError, match=r"Options.links\['inter'\]=1.0 is not a Link"):
        autopar.Options(links={X: 1.0})


def test_compile_checks_the_layout_before_any_collective(monkeypatch):
    # a process group of 8 ranks that torchrun runs 2 per node: nodes=2 cannot be right,
    # and compile says so before it builds process groups or plans
    import autopar.api as api
    monkeypatch.setattr(api.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(api.dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(api, "ParallelModule", lambda *a, **k: pytest.fail("reached the runtime"))
    with pytest.raises(MeshError, match=r"nodes=2 puts 4 ranks on each node.*pass nodes=4"):
        autopar.compile(models.build("mlp"), mesh=(2, 4), nodes=2)
    with pytest.raises(MeshError, match=r"nodes=3 does not divide the 8 ranks"):
        autopar.compile(models.build("mlp"), mesh=(2, 4), nodes=3)


# ---- the solver puts tensor parallelism on the fast axis -------------------------------------
@pytest.fixture(scope="module")
def gpt2_two_nodes():
    """A one-layer GPT-2 (hidden 128) traced once and planned for training on (2, 4) over
    2 nodes, with the inter-node link 20x slower than the intra-node one, and with the
    two swapped."""
    model = models.build("gpt2", n_embd=128, n_layer=1).train()
    _, kw = models.inputs("gpt2", batch=2, seq=16)
    fast = Link(5e-6, 1 / 10e9, "fast")
    slow = Link(20 * fast.alpha_s, 20 * fast.beta_s_per_byte, "slow")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_for_planning(model, (), kw)
        return {name: plan_traced(traced, Mesh((2, 4)), autopar.Options(device="cpu", nodes=2, links=links))[1]
                for name, links in {"inter slow": {I: fast, X: slow}, "intra slow": {I: slow, X: fast}}.items()}


def _split_axes(plan: Plan, word: str) -> dict[int, int]:
    """How many 2-D weights whose name holds `word` each mesh axis shards."""
    counts = {0: 0, 1: 0}
    for n in plan.nodes:
        if n.kind is NodeKind.PARAMETER and word in n.name and len(n.outputs[0].meta.shape) == 2:
            for axis, p in enumerate(n.outputs[0].placements):
                counts[axis] += str(p).startswith("S")
    return counts


def test_tensor_parallelism_lands_on_the_fast_axis(gpt2_two_nodes):
    inter_slow, intra_slow = gpt2_two_nodes["inter slow"], gpt2_two_nodes["intra slow"]
    assert [(a.kind, a.link.name) for a in inter_slow.links] == [(X, "slow"), (I, "fast")]
    assert [(a.kind, a.link.name) for a in intra_slow.links] == [(X, "fast"), (I, "slow")]
    # attention's two weights (c_attn, c_proj): Megatron-split on the fast axis only
    assert _split_axes(inter_slow, "attn") == {0: 0, 1: 2}
    assert _split_axes(intra_slow, "attn") == {0: 2, 1: 0}
    every_weight = _split_axes(inter_slow, "")
    assert every_weight[1] > every_weight[0], every_weight
    assert "axis 0 slow (inter-node" in inter_slow.summary() and "axis 1 fast (intra-node" in inter_slow.summary()


def test_evaluate_prices_a_two_node_plan_with_its_own_links(gpt2_two_nodes):
    """evaluate re-prices a plan with the links it was planned with (Plan.links), so its
    total equals the solver's for a plan over two nodes; with one node's links it would not."""
    from autopar.cost_models.evaluate import evaluate
    for plan in gpt2_two_nodes.values():
        assert evaluate(plan).total_s == pytest.approx(plan.total_s, rel=1e-9)
    plan = gpt2_two_nodes["inter slow"]
    one_node = evaluate(plan, cost_model=CostModel.analytic("cpu", (2, 4), training=True))
    assert one_node.total_s != pytest.approx(plan.total_s, rel=1e-9)


def test_plan_links_survive_json(gpt2_two_nodes, tmp_path):
    plan = gpt2_two_nodes["inter slow"]
    path = str(tmp_path / "plan.json")
    plan.to_json(path)
    with open(path) as f:
        stored = json.load(f)
    assert [(a["kind"], a["name"]) for a in stored["links"]] == [("inter", "slow"), ("intra", "fast")]
    assert Plan.from_json(path).links == plan.links
    del stored["links"]  # a file written before links were recorded
    assert Plan.from_dict(stored).links == ()
    stored["links"] = plan.to_dict()["links"][:1]  # a hand-edited file: axis 1 has no link
    with pytest.raises(PlanFileError, match="1 links for the 2 axes"):
        Plan.from_dict(stored)


def test_the_pictures_name_each_axis_link(gpt2_two_nodes):
    from autopar.tools.visualize import mesh_label, tensor_blocks
    plan = gpt2_two_nodes["inter slow"]
    assert mesh_label(plan) == "(2, 4) [axis 0 inter-node slow, axis 1 intra-node fast]"
    fig = tensor_blocks(plan, ["p_transformer_h_0_attn_c_attn_weight"])
    assert "axis 0 inter-node slow" in fig._suptitle.get_text()


def test_the_cli_plans_for_several_nodes(tmp_path, capsys):
    from autopar.tools.cli import main
    path = str(tmp_path / "plan.json")
    assert main(["plan", "gpt2-tiny", "--mesh", "2,4", "--device", "h100", "--nnodes", "2", "--out", path]) == 0
    assert "axis 0 ib-400g (inter-node" in capsys.readouterr().out
    assert [a.kind for a in Plan.from_json(path).links] == [X, I]


def test_a_calibration_is_applied_only_to_axes_of_its_kind():
    fit = {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9, "residual": 0.0}
    profile = Profile("cpu", comm={"0:all_reduce": {**fit, "ranks": 2, "link": "intra"},  # measured on one node
                                   "1:all_reduce": {**fit, "ranks": 4}})  # written before kinds were stored
    assert set(profile.links((2, 4))) == {(0, "all_reduce"), (1, "all_reduce")}
    assert set(profile.links((2, 4), Mesh((2, 4)).link_kinds(2))) == {(1, "all_reduce")}
    profile.comm["0:all_reduce"]["link"] = "inter"
    assert set(profile.links((2, 4), Mesh((2, 4)).link_kinds(2))) == {(0, "all_reduce"), (1, "all_reduce")}


# ---- two torchrun agents as two nodes --------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(out: str, timeout_s: float) -> list[subprocess.CompletedProcess]:
    """examples/two_nodes.py under two torchrun agents (node ranks 0 and 1, 4 ranks each,
    c10d rendezvous on loopback); both killed, with their workers, if either outlives
    `timeout_s` or the test fails."""
    port, procs = _free_port(), []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=60", "--max-restarts", "0",
                   "--monitor-interval", "0.2", os.path.join(ROOT, "examples", "two_nodes.py"), "--out", out,
                   "--calibrate"]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        done = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the agent's session: it and its 4 workers
                p.wait()


@pytest.mark.slow  # two torchrun agents, 8 ranks on this machine (~30 s)
def test_two_torchrun_nodes_plan_alike_and_match_one_device(tmp_path):
    out = str(tmp_path / "result.json")
    for node, done in enumerate(_agents(out, timeout_s=150)):
        assert done.returncode == 0, f"agent {node} failed ({done.returncode}):\n{done.stderr[-6000:]}"
    with open(out) as f:
        result = json.load(f)
    ranks = result["ranks"]
    assert result["world"] == 8 and [r["rank"] for r in ranks] == list(range(8))
    assert [r["node"] for r in ranks] == [0] * 4 + [1] * 4  # torchrun numbers ranks node-major
    assert len({r["digest"] for r in ranks}) == 1
    assert result["links"] == [["inter", "inter-slow"], ["intra", "intra-fast"]]
    # Megatron's column/row split on the intra-node axis, nothing split across nodes
    assert result["placements"] == {"p_0_weight": "RS(0)", "p_2_weight": "RS(1)", "p_4_weight": "RS(0)",
                                    "p_6_weight": "RS(1)"}
    for r in ranks:
        assert r["out_err"] < 1e-5 and r["grad_err"] < 1e-5, r
        # each axis calibrated on the rank's own group of it, tagged with its kind
        assert {k: (f["ranks"], f["link"]) for k, f in r["calibrated"].items() if k.endswith("all_reduce")} == \
            {"0:all_reduce": (2, "inter"), "1:all_reduce": (4, "intra")}
        assert all(f["alpha_s"] > 0 for f in r["calibrated"].values())
