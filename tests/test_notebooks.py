"""The notebooks run top to bottom in CI, on the committed sample data, and draw their plots."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_and_plots(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # start from a clean slate: no committed output may hide an error
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no plot"
