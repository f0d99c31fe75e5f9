"""bench/gpu_suite.sh, the one script run when a GPU machine is lent, works before one is:
its dry run takes every step on this CPU at tiny sizes and writes the results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT, plain_env


@pytest.mark.slow  # three steps, each its own interpreter (~35 s)
def test_the_gpu_suite_dry_run_takes_every_step_and_writes_one_results_file(tmp_path):
    done = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_suite.sh"), "--dry-run"], cwd=ROOT,
                          env=plain_env(OUT=str(tmp_path), PYTHON=sys.executable), capture_output=True, text=True,
                          timeout=600)
    results = (tmp_path / "gpu_suite.txt").read_text()
    assert done.returncode == 0, results[-4000:]
    assert results.splitlines()[-1] == "gpu_suite: 3 of 3 steps passed", results[-2000:]
    for line in ("## gpu tests: exit 0", "## gpu step: exit 0", "## gpu profile: exit 0",
                 "worst one-rank autopar/plain ratio:", "predicted/measured step:"):
        assert line in results, (line, results[-3000:])
    profiles = [p for p in os.listdir(tmp_path) if p.startswith("profile-")]
    assert len(profiles) == 1, profiles
    with open(tmp_path / profiles[0]) as f:
        assert json.load(f)  # the profile a GPU run leaves to ship
