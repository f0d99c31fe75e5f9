"""The README's first example runs as written, under torchrun, on 2 gloo ranks (autopar
starts the process group itself)."""

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
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env={**env, "HF_HUB_OFFLINE": "1", "AUTOPAR_LOG": "info"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.count("Plan for GPT2LMHeadModel on mesh (2,)") == 2, done.stdout[-3000:]
    assert done.stdout.count("def forward") == 2  # each rank printed its program
    # rank 0 solved for the ranks, then each rank planned (2, 4) offline for H100s
    assert done.stderr.count("autopar: solve: ") == 3, done.stderr[-3000:]
    assert done.stderr.count("started the gloo process group") == 2, done.stderr[-3000:]
