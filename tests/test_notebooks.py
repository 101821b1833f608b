"""The notebooks: committed clean, and every one runs top to bottom.

Notebooks are committed with outputs stripped (reviewable diffs; what a user sees is what
their own kernel computes) and the `python3` kernel (any other name fails with "No such
kernel" on a machine that lacks it). Each one is executed here with nbclient, in the
notebooks/ directory, on the kernel of the Python running pytest (jupyter_client starts
a `python` kernelspec with sys.executable). The notebooks assert their own claims, so a
change that makes a sentence of a notebook false fails here, naming the cell.

Every notebook also shows its figures: the first code cell runs `%matplotlib inline`
(which makes IPython render `matplotlib.figure.Figure` objects; without it a bare
Figure displays as text), and the executed notebook must contain PNG outputs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
EXPECTED = ["00_tour", "01_collectives", "02_data_parallel", "03_zero", "04_tensor_parallel",
            "05_pipeline_parallel", "06_3d_combined", "07_interview_drill",
            "08_system_optimisations"]
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell; a notebook takes seconds, this only catches a hang


def read(path: Path):
    return nbformat.read(path, as_version=4)


def test_the_notebooks_of_the_course_are_all_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean(path):
    notebook = read(path)
    nbformat.validate(notebook)
    assert notebook.metadata.get("kernelspec", {}).get("name") == "python3"
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, "a notebook without code"
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has committed outputs: strip them"
            assert cell.execution_count is None, f"cell {i} has an execution count"
    assert code[0].source.startswith("%matplotlib inline"), (
        "the first code cell must run %matplotlib inline, or figures show as text")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    notebook = read(path)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    started = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed:\n{str(error)[-4000:]}")
    seconds = time.perf_counter() - started
    images = sum("image/png" in output.get("data", {})
                 for cell in notebook.cells if cell.cell_type == "code"
                 for output in cell.outputs)
    assert images > 0, f"{path.name} shows no figure"
    assert seconds < 60, f"{path.name} took {seconds:.0f} s; notebooks should take seconds"
