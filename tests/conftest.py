"""Test-wide settings: tests marked `gpu` are skipped on a machine without CUDA.

The markers themselves are declared in pyproject.toml ([tool.pytest.ini_options]):
`slow` (8-rank spawns, notebooks, CLI subprocesses; `pytest -m "not slow"` is the quick
set) and `gpu`."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
