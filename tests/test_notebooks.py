"""The notebooks are committed executed, pictures included (a visitor browsing the
repository sees them), and still run top to bottom and draw their pictures (slow: a
kernel per notebook). Drawing leaves the user's matplotlib backend alone.

After changing a notebook or what it shows, commit it executed:

    HF_HUB_OFFLINE=1 jupyter execute --inplace notebooks/*.ipynb
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
MIN_PICTURES = {"01_quickstart.ipynb": 1, "02_visualize_shardings.ipynb": 10}
MAX_BYTES = 2 * 2**20


def _pictures(nb) -> int:
    return sum(1 for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
               if "image/png" in out.get("data", {}))


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(MIN_PICTURES)


@pytest.mark.parametrize("name", sorted(MIN_PICTURES))
def test_notebook_is_committed_executed_with_its_pictures(name):
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), f"{name}: cells not run once, in order: {counts}"
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{name} was committed with an error: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    assert _pictures(nb) >= MIN_PICTURES[name], f"{name} was committed with {_pictures(nb)} pictures"
    assert path.stat().st_size < MAX_BYTES, f"{name} is {path.stat().st_size} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MIN_PICTURES))
def test_notebook_executes_and_draws(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    pictures = _pictures(nb)
    assert pictures >= MIN_PICTURES[name], f"{name} drew {pictures} pictures, expected {MIN_PICTURES[name]}"


def test_pictures_leave_the_matplotlib_backend_alone(monkeypatch):
    # a backend the user chose and autopar does not know (a notebook's is "inline" in
    # matplotlib 3.11): drawing must neither switch it nor need it to be Agg
    import matplotlib
    import torch

    import autopar
    from autopar.tools.visualize import visualize
    from tests.models import MLP
    plt = pytest.importorskip("matplotlib.pyplot")
    original, switch_backend = matplotlib.get_backend(), plt.switch_backend
    switch_backend("svg")
    try:
        switched = []
        monkeypatch.setattr(matplotlib, "use", lambda *a, **k: switched.append(a))
        monkeypatch.setattr(plt, "switch_backend", lambda *a, **k: switched.append(a))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(MLP().eval(), (torch.randn(8, 16),), mesh=(2, 2))
        figs = visualize(plan)
        assert switched == [] and matplotlib.get_backend() == "svg"
        assert set(figs) == {"tensors", "graph", "layers", "costs"}
    finally:
        monkeypatch.undo()
        switch_backend(original)  # closes the figures too
