"""Runs every notebook in notebooks/ top to bottom on the CPU; a cell that raises fails the test, and so does a
cell that prints here but has no output stored in the file (what a reader sees without running it).

Select or skip these with the marker: python -m pytest -m notebooks / -m "not notebooks".
"""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install -r requirements.txt")
nbclient = pytest.importorskip("nbclient", reason="pip install -r requirements.txt")
from nbclient.exceptions import CellExecutionError  # noqa: E402

pytestmark = pytest.mark.notebooks

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})  # cwd = notebooks/
    stored = [cell.get("outputs") for cell in nb.cells]
    try:
        client.execute()  # outputs go to the in-memory copy only; the file on disk is left as it is
    except CellExecutionError as error:
        pytest.fail(f"{path.name}: a cell raised\n{error}", pytrace=False)
    missing = [i for i, (cell, old) in enumerate(zip(nb.cells, stored)) if cell.get("outputs") and not old]
    assert not missing, f"{path.name}: cells {missing} print but have no stored output (run the notebook and save it)"
