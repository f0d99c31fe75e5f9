"""The README's first example runs as written, under torchrun (started by `python -m
autopar run`), on 2 gloo ranks (autopar starts the process group itself)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def first_python_block() -> str:
    return re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


@pytest.mark.slow  # a torchrun job of 2 ranks
def test_the_readmes_first_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "first.py"
    script.write_text(first_python_block())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # through autopar's launcher, which hands torchrun a standalone rendezvous of 2 ranks
    done = subprocess.run([sys.executable, "-m", "autopar", "run", "--nproc", "2", str(script)], cwd=tmp_path,
                          env={**env, "HF_HUB_OFFLINE": "1", "AUTOPAR_LOG": "info"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.count("Plan for GPT2LMHeadModel on mesh (2,)") == 2, done.stdout[-3000:]
    assert done.stdout.count("def forward") == 2  # each rank printed its program
    # rank 0 solved for the ranks, then each rank planned (2, 4) offline for H100s
    assert done.stderr.count("autopar: solve: ") == 3, done.stderr[-3000:]
    assert done.stderr.count("started the gloo process group") == 2, done.stderr[-3000:]


def test_the_launcher_hands_torchrun_a_rendezvous():
    from autopar.tools.cli import _parser, torchrun_argv
    args = _parser().parse_args(["run", "--nproc", "4", "train.py", "--lr", "3e-4"])
    assert torchrun_argv(args) == ["--nproc-per-node=4", "--nnodes=1", "--standalone", "train.py", "--lr", "3e-4"]
    args = _parser().parse_args(["run", "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "train.py"])
    assert torchrun_argv(args)[:4] == ["--nproc-per-node=auto", "--nnodes=2", "--rdzv-backend=c10d",
                                       "--rdzv-endpoint=node0:29500"]
    with pytest.raises(ValueError, match="--nnodes 2 needs --rdzv-endpoint"):
        torchrun_argv(_parser().parse_args(["run", "--nnodes", "2", "train.py"]))


def test_the_launcher_refuses_a_missing_script(capsys):
    from autopar.tools.cli import main
    assert main(["run", "--nproc", "2", "no_such_script.py"]) == 1
    assert "no script 'no_such_script.py' to run" in capsys.readouterr().err


@pytest.mark.slow  # a torchrun job of 2 ranks
def test_a_failing_rank_is_named_with_its_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "autopar", "run", "--nproc", "2", str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "1 rank(s) of" in done.stderr and "exitcode" in done.stderr and ": 3" in done.stderr, done.stderr[-2000:]
