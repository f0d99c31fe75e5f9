"""The notebooks run top to bottom and draw their pictures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
MIN_PICTURES = {"01_quickstart.ipynb": 1, "02_visualize_shardings.ipynb": 10}


@pytest.mark.parametrize("name", sorted(MIN_PICTURES))
def test_notebook_executes_and_draws(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    pictures = sum(1 for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
                   if "image/png" in out.get("data", {}))
    assert pictures >= MIN_PICTURES[name], f"{name} drew {pictures} pictures, expected {MIN_PICTURES[name]}"
