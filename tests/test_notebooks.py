"""Execute every notebook under ``notebooks/`` (their quick size) with nbclient.

A cell that raises -- including the notebooks' own ``assert`` cells, which check the
claims the studies make -- fails the test, and so the CI build. The executed copy is
thrown away; the committed notebooks keep the outputs of their last deliberate run
(``python notebooks/run_all.py`` rewrites them in place).
"""
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat", reason="notebook execution needs the test extra")
nbclient = pytest.importorskip("nbclient", reason="notebook execution needs the test extra")


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 4, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("FASTANNEAL_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()       # raises CellExecutionError naming the cell on any error
    errors = [o for c in nb.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
