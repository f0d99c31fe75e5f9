"""Plans as artifacts: JSON round trip, validation, explain/diff, pictures, CLI, and
plan files driving real gloo ranks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch

import autopar
from autopar.core.errors import PlanFileError
from tests import cases, models
from tests.harness import run_ranks


def _plan(name="gpt2", mesh=(2, 2), device=None, batch=4, **kw):
    m = models.build(name, **kw)
    args, kwargs = models.inputs(name, batch=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(m, args, kwargs, mesh=mesh, device=device or cases.CHEAP_COMM)


@pytest.fixture(scope="module")
def gpt2_plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    sharded, replicated = _plan(), _plan(device="cpu")
    paths = {"sharded": folder / "sharded.json", "replicated": folder / "replicated.json"}
    sharded.to_json(paths["sharded"])
    replicated.to_json(paths["replicated"])
    return sharded, replicated, {k: str(v) for k, v in paths.items()}


def test_json_round_trip_is_exact(gpt2_plans, tmp_path):
    plan, _, paths = gpt2_plans
    loaded = autopar.Plan.from_json(paths["sharded"])
    assert loaded == plan
    assert loaded.digest() == plan.digest()
    data = json.loads(open(paths["sharded"]).read())
    for key in ("schema_version", "autopar_version", "torch_version", "mesh", "fingerprint", "nodes",
                "collectives", "predicted", "solver"):
        assert key in data
    assert data["schema_version"] == 1 and data["mesh"] == [2, 2]
    assert {"objective_s", "gap", "solve_time_s", "status"} <= set(data["solver"])


def test_write_is_atomic_and_leaves_no_temporary_files(gpt2_plans, tmp_path):
    plan = gpt2_plans[0]
    target = tmp_path / "p.json"
    target.write_text("old contents")

    class Boom(Exception):
        pass

    import autopar.core.files as files

    def failing_dump(*a, **k):
        raise Boom()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files.json, "dump", failing_dump)
        with pytest.raises(Boom):
            plan.to_json(target)
    assert target.read_text() == "old contents"  # the old file is untouched
    assert os.listdir(tmp_path) == ["p.json"]  # and no temporary file is left behind
    plan.to_json(target)
    assert autopar.Plan.from_json(target) == plan


@pytest.mark.parametrize("damage,phrase", [
    (lambda s: s[: len(s) // 2], "corrupt or truncated"),
    (lambda s: "not json at all", "corrupt or truncated"),
    (lambda s: s.replace('"schema_version":1', '"schema_version":99'), "schema version 99"),
    (lambda s: s.replace('"schema":"autopar.plan"', '"schema":"other"'), "not an autopar plan"),
    (lambda s: s.replace('"nodes":', '"nodez":'), "damaged"),
])
def test_damaged_files_fail_clearly(gpt2_plans, tmp_path, damage, phrase):
    text = open(gpt2_plans[2]["sharded"]).read()
    bad = tmp_path / "bad.json"
    bad.write_text(damage(text))
    with pytest.raises(PlanFileError) as err:
        autopar.Plan.from_json(bad)
    assert phrase in str(err.value) and str(bad) in str(err.value)


def test_explain_lists_alternatives_and_says_why(gpt2_plans):
    plan = gpt2_plans[0]
    text = plan.explain("addmm")
    assert text.startswith("addmm (aten.addmm.default")
    assert "->" in text and "why:" in text
    node = plan.node("addmm")
    assert f"{len(node.options)} strategies" in text
    chosen_line = next(line for line in text.splitlines() if line.startswith("  ->"))
    assert ",".join(map(str, node.outputs)) in chosen_line


def test_diff_names_changed_nodes_and_cost_delta(gpt2_plans):
    sharded, replicated, _ = gpt2_plans
    text = sharded.diff(replicated)
    changed = [n.name for n, m in zip(sharded.nodes, replicated.nodes) if n.outputs != m.outputs]
    assert changed, "the two cost models should give different plans"
    assert f"{len(changed)} nodes differ" in text
    assert all(f"    {name}:" in text for name in changed)
    assert "delta" in text
    assert "0 nodes differ" in sharded.diff(sharded)


@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_visualize_returns_images(name):
    from autopar.tools.visualize import visualize
    plan = _plan(name, mesh=(2, 2))
    figs = visualize(plan)
    assert set(figs) == {"tensors", "graph", "layers", "costs"}
    for fig in figs.values():
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n" and len(buf.getvalue()) > 5000


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "autopar", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


def _cli_here(*argv) -> subprocess.CompletedProcess:
    """The command line's main() in this process (what `python -m autopar` calls; the
    docs' shell block and the closed-pipe test run the real entry point), without an
    interpreter and torch import per command."""
    from autopar.tools.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's refusals
            code = e.code
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


@pytest.mark.slow  # seven commands, three of them plan
def test_cli_plan_show_diff_code(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r = _cli_here("plan", "gpt2-tiny", "--mesh", "2,2", "--out", str(a))
    assert r.returncode == 0, r.stderr
    assert "Plan for GPT2LMHeadModel" in r.stdout and a.exists()
    assert _cli_here("plan", "gpt2-tiny", "--mesh", "2,2", "--out", str(b), "--device", "h100").returncode == 0
    r = _cli_here("show", str(a), "--nodes", "--all")
    assert r.returncode == 0 and "collectives by module" in r.stdout and "lm_head" in r.stdout, r.stdout
    assert "every collective (forward order)" in r.stdout
    r = _cli_here("explain", str(a), "addmm")
    assert r.returncode == 0 and "addmm (aten.addmm.default, in transformer.h.0.attn.c_attn)" in r.stdout, r.stdout
    r = _cli_here("explain", str(a), "no_such_node")
    assert r.returncode == 1 and "has no node 'no_such_node'" in r.stderr and "ops: " in r.stderr, r.stderr
    r = _cli_here("visualize", str(a), "--out", str(tmp_path / "pictures"))
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "pictures").iterdir()) == [
        "plan_costs.png", "plan_graph.png", "plan_layers.png", "plan_tensors.png"], r.stderr
    assert r.stdout.count(".png") == 4, r.stdout
    r = _cli_here("report", str(a), "--out", str(tmp_path / "report" / "plan.html"))
    page = (tmp_path / "report" / "plan.html").read_text()
    assert r.returncode == 0 and str(tmp_path / "report" / "plan.html") in r.stdout, r.stderr
    assert page.count("<svg") == 3 and "Plan for GPT2LMHeadModel" in page
    r = _cli_here("report", str(a), "--out", str(tmp_path))  # a folder, not a file
    assert r.returncode == 1 and "is a folder" in r.stderr, r.stderr
    r = _cli_here("diff", str(a), str(b))
    assert r.returncode == 0 and "nodes differ" in r.stdout
    r = _cli_here("code", "gpt2-tiny", "--mesh", "2,2", "--rank", "3", "--plan", str(a))
    assert r.returncode == 0 and "def forward" in r.stdout and "rank 3 at mesh coordinates (1, 1)" in r.stdout


@pytest.mark.slow  # traces two zoo models
def test_cli_coverage_reports_rule_sources():
    # Mixtral's routing (sort by expert, histc counts, grouped expert matmuls, unsort) is
    # one routed_experts op per layer (passes/trace/experts.py), with a hand rule
    r = _cli_here("coverage", "gpt2-tiny", "mixtral-tiny", "--mesh", "2,2", "--ops")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    gpt2 = next(line for line in lines if line.startswith("gpt2-tiny")).split()
    assert gpt2[2:4] == ["0", "0"] and int(gpt2[1]) > 50  # all ops hand-ruled
    mixtral = next(line for line in lines if line.startswith("mixtral-tiny")).split()
    assert mixtral[2:4] == ["0", "0"]
    assert "discovered:" not in r.stdout and "replicated:" not in r.stdout
    assert "autopar.routed_experts.default x2" in r.stdout  # listed among the hand-ruled ops
    assert "speedup" in lines[1]


def test_a_plan_file_gets_the_modes_open_would_give_it(gpt2_plans, tmp_path):
    mask = os.umask(0)
    os.umask(mask)
    path = tmp_path / "plan.json"
    gpt2_plans[0].to_json(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~mask  # not mkstemp's 0600


def test_dir_of_the_package_lists_its_public_names():
    names = dir(autopar)
    assert {"compile", "plan", "Options", "ParallelModule", "__version__"} <= set(names)
    assert not {"Any", "annotations", "importlib"} & set(names), names


def test_the_cli_says_its_version_and_refuses_sizes_a_factory_ignores(capsys):
    from autopar.tools.cli import main
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"autopar {autopar.__version__}"
    assert main(["plan", "tests.models:mlp_factory", "--mesh", "2", "--seq", "64", "--out", "x.json"]) == 1
    assert "--batch and --seq size a zoo model's inputs" in capsys.readouterr().err


@pytest.mark.slow  # CLI subprocesses
def test_cli_output_cut_by_a_closed_pipe_ends_quietly(tmp_path):
    path = tmp_path / "plan.json"
    assert _cli("plan", "gpt2-small", "--mesh", "2,4", "--out", str(path)).returncode == 0  # on meta: no weights
    done = subprocess.run(f"{sys.executable} -m autopar show {path} --nodes | head -1", shell=True,
                          capture_output=True, text=True, executable="/bin/bash", timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.stdout.startswith("Plan for GPT2LMHeadModel") and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow  # CLI subprocesses
def test_cli_errors_have_exit_codes(tmp_path):
    r = _cli("show", str(tmp_path / "missing.json"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = _cli("plan", "no-such-model", "--mesh", "2,2", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 1 and "gpt2-tiny" in r.stderr
    r = _cli("plan", "gpt2-tiny", "--mesh", "two", "--out", "x.json")
    assert r.returncode == 2


@pytest.mark.slow  # 4 ranks, 3 compiles, one waiting for the start-up check to fail
def test_plan_files_on_gloo_ranks(gpt2_plans):
    sharded, replicated, paths = gpt2_plans
    batch = [
        (cases.compile_from_plan_file, dict(plan_path=paths["sharded"], mesh=(2, 2))),
        (cases.plan_file_for_other_model, dict(plan_path=paths["sharded"], mesh=(2, 2))),
        (cases.mismatched_plans, dict(plan_paths=[paths["sharded"], paths["replicated"]], mesh=(2, 2))),
    ]
    results = run_ranks(4, batch)
    for rank, (same, other, mismatch) in enumerate(results):
        # 1. the saved plan runs and matches the single-device model
        for got, want in zip(same["parallel"], same["reference"]):
            torch.testing.assert_close(got, want)
        assert same["digest"] == sharded.digest()
        # 2. a plan for another model is refused by fingerprint
        assert other["error_type"] == "FingerprintMismatchError" and "fingerprint" in other["message"]
        # 3. different plans on different ranks fail fast on every rank
        assert mismatch["error_type"] == "ProcessGroupError", (rank, mismatch)
        assert "different plans" in mismatch["message"]
        assert mismatch["seconds"] < 60


def test_show_groups_collectives_by_the_module_that_reads_them(gpt2_plans):
    from autopar.tools.plan_text import collectives_by_module
    sharded = gpt2_plans[0]
    lines = collectives_by_module(sharded)
    assert lines and all("MiB" in line and "@axis" in line for line in lines), lines
    counted = sum(int(part.split(" x")[1].split()[0]) for line in lines for part in line.split(", "))
    assert counted == len(sharded.collectives())  # every collective in exactly one module's line
