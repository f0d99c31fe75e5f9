"""The autopar logger: quiet unless asked, each planning stage with its time when it is."""

from __future__ import annotations

import pytest

import logging
import os
import subprocess
import sys

import torch

import autopar
from tests.models import MLP

CODE = "import torch, autopar; from tests.models import MLP; autopar.plan(MLP(), (torch.randn(4, 16),), mesh=(2,))"


def test_planning_logs_each_stage_with_its_time_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="autopar"):
        autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=(2,))
    lines = [r.getMessage() for r in caplog.records if r.name == "autopar"]
    for stage in ("trace", "strategies", "solve"):
        assert any(line.startswith(f"{stage}: ") and " s (" in line for line in lines), (stage, lines)
    assert any("Optimal" in line and "variables" in line for line in lines), lines


@pytest.mark.slow  # subprocesses or gloo ranks: in the full suite, out of the fast set
def test_quiet_by_default_and_on_stderr_with_autopar_log():
    env = {k: v for k, v in os.environ.items() if k != "AUTOPAR_LOG"}
    quiet = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 0 and "autopar: " not in quiet.stderr, quiet.stderr
    loud = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          env={**env, "AUTOPAR_LOG": "info"}, timeout=300)
    assert loud.returncode == 0 and "autopar: trace: " in loud.stderr and "autopar: solve: " in loud.stderr, loud.stderr


def test_a_long_stage_says_it_is_still_running(caplog, monkeypatch):
    from autopar.core import log
    monkeypatch.setattr(log, "HEARTBEAT_S", 0.05)

    @log.logged("slow stage", lambda out: f"made {out}")
    def slow() -> int:
        import time
        time.sleep(0.3)
        return 3

    with caplog.at_level(logging.INFO, logger="autopar"):
        assert slow() == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "autopar"]
    beats = [line for line in lines if line.startswith("slow stage: still running, ")]
    assert len(beats) >= 2 and lines[-1].startswith("slow stage: ") and lines[-1].endswith("(made 3)"), lines
    with caplog.at_level(logging.WARNING, logger="autopar"):  # quiet: no thread, no line
        caplog.clear()
        assert slow() == 3
    assert not caplog.records
