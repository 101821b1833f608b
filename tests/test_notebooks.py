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

And every notebook asks before it measures: code cells tagged `predict` hold the
reader's prediction (a literal default, the common answer, which the run here uses), a
later cell compares it with the measurement (`minipar.viz.predict`), and a markdown cell
tagged `self-check` closes the notebook; the drill (07) hides each answer in a
<details> block between the prediction and the experiment.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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
def test_notebook_runs_top_to_bottom(path, record_property):
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
    # How long it took is recorded, not asserted: a wall-clock limit fails on a loaded
    # machine, not on slow code (pytest --junitxml=... keeps it; --durations shows it).
    record_property("seconds", round(seconds, 1))


# ------------------------------------------------------------------ opening does not dirty
# What JupyterLab writes when it runs a notebook on the python3 kernel, but the version.
JUPYTERLAB_METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                   "name": "python3"},
    "language_info": {"codemirror_mode": {"name": "ipython", "version": 3},
                      "file_extension": ".py", "mimetype": "text/x-python", "name": "python",
                      "nbconvert_exporter": "python", "pygments_lexer": "ipython3"}}
EXTRA_KEYS = "metadata.language_info.version"  # docs/notebooks.md, the filter's extrakeys


def strip(data: bytes) -> bytes:
    """What the git clean filter stores: nbstripout on stdin, with the repo's extra keys."""
    pytest.importorskip("nbstripout")
    return subprocess.run([sys.executable, "-m", "nbstripout", "--extra-keys", EXTRA_KEYS],
                          input=data, capture_output=True, check=True).stdout


def as_run_in_jupyterlab(path: Path) -> bytes:
    """The notebook as JupyterLab saves it after Run All: outputs, execution counts, the
    kernel's Python version, widget state."""
    notebook = read(path)
    count = 0
    for cell in notebook.cells:
        if cell.cell_type == "code":
            count += 1
            cell.execution_count = count
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
    notebook.metadata["language_info"]["version"] = sys.version.split()[0]
    notebook.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {}}
    return nbformat.writes(notebook).encode() + b"\n"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_carries_the_metadata_jupyterlab_writes(path):
    assert {key: read(path).metadata.get(key) for key in JUPYTERLAB_METADATA} == (
        JUPYTERLAB_METADATA)


@pytest.fixture(scope="module")
def stripped(tmp_path_factory) -> dict[tuple[str, str], bytes]:
    """{(notebook stem, "committed" | "run"): what nbstripout makes of it}, for every
    notebook, from one nbstripout process over copies of all of them (one process per
    file costs ~1.5 s of start-up each). In-place mode writes with the same nbformat
    writer as the stdin mode the git filter uses (`strip`, which the scratch-repository
    test below runs through git itself)."""
    pytest.importorskip("nbstripout")
    folder = tmp_path_factory.mktemp("stripped")
    files = {}
    for path in NOTEBOOKS:
        for kind, data in (("committed", path.read_bytes()), ("run", as_run_in_jupyterlab(path))):
            files[path.stem, kind] = folder / f"{path.stem}.{kind}.ipynb"
            files[path.stem, kind].write_bytes(data)
    subprocess.run([sys.executable, "-m", "nbstripout", "--extra-keys", EXTRA_KEYS,
                    *map(str, files.values())], capture_output=True, check=True)
    return {key: file.read_bytes() for key, file in files.items()}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_clean_filter_leaves_a_committed_notebook_and_strips_a_run_one_back(path, stripped):
    committed = path.read_bytes()
    assert stripped[path.stem, "committed"] == committed  # a fresh clone is clean
    assert stripped[path.stem, "run"] == committed


def test_the_filter_on_standard_input_strips_as_the_batch_above_does(stripped):
    """The git filter reads the notebook on stdin: same bytes as the in-place batch."""
    path = NOTEBOOKS[-1]
    assert strip(as_run_in_jupyterlab(path)) == stripped[path.stem, "run"]


def test_gitattributes_route_notebooks_through_nbstripout():
    assert "*.ipynb filter=nbstripout diff=ipynb" in (ROOT / ".gitattributes").read_text()


def test_with_the_filter_configured_a_run_notebook_has_nothing_to_commit(tmp_path):
    """The documented setup (docs/notebooks.md), in a scratch repository. (`git status`
    lists a file whose size changed as modified before it runs the filter, so it is
    `git diff` and `git add` that say nothing changed.)"""
    pytest.importorskip("nbstripout")
    path = NOTEBOOKS[0]

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "test")
    git("config", "filter.nbstripout.clean", f'"{sys.executable}" -m nbstripout')
    git("config", "filter.nbstripout.smudge", "cat")
    git("config", "filter.nbstripout.extrakeys", EXTRA_KEYS)
    (tmp_path / ".gitattributes").write_text((ROOT / ".gitattributes").read_text())
    (tmp_path / path.name).write_bytes(path.read_bytes())
    git("add", ".")
    git("commit", "-qm", "notebook")
    (tmp_path / path.name).write_bytes(as_run_in_jupyterlab(path))
    assert git("diff") == ""
    git("add", "-A")
    assert git("status", "--porcelain") == ""  # nothing staged: the commit would be empty


# ------------------------------------------------------------------ predict, then measure
def tagged(notebook, tag: str) -> list[int]:
    return [i for i, cell in enumerate(notebook.cells) if tag in cell.metadata.get("tags", [])]


def predicted_names(cell) -> list[str]:
    """The names a `predict` cell sets: it may only assign literals (a number, a string),
    so a reader's own value replaces the default without touching the experiment."""
    names = []
    for statement in ast.parse(cell.source).body:
        assert isinstance(statement, ast.Assign) and len(statement.targets) == 1, (
            f"a predict cell holds only `name = value` lines, not {ast.dump(statement)[:60]}")
        assert isinstance(statement.value, ast.Constant), "a prediction is a literal"
        names.append(statement.targets[0].id)
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_asks_for_a_prediction_and_then_measures_it(path):
    notebook = read(path)
    asks = tagged(notebook, "predict")
    assert asks, f"{path.name} asks for no prediction (a code cell tagged predict)"
    for i in asks:
        assert notebook.cells[i].cell_type == "code"
        for name in predicted_names(notebook.cells[i]):
            later = [cell.source for cell in notebook.cells[i + 1:] if cell.cell_type == "code"]
            judged = [source for source in later
                      if re.search(rf"judge(_choice)?\(\s*{name}\b", source)]
            assert judged, (f"{path.name}: the prediction {name} is never compared with "
                            "a measurement")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_ends_with_a_self_check(path):
    notebook = read(path)
    checks = tagged(notebook, "self-check")
    assert checks, f"{path.name} has no cell tagged self-check"
    cell = notebook.cells[checks[-1]]
    assert cell.cell_type == "markdown" and cell.source.count("<details>") >= 3
    assert checks[-1] > max(tagged(notebook, "predict"))  # after the experiments


def test_the_drill_asks_first_and_hides_its_answers_until_the_experiment():
    """07: each question, then the prediction, then the answer in <details>, then the
    experiment that decides."""
    notebook = read(NOTEBOOK_DIR / "07_interview_drill.ipynb")
    heads = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "markdown"
             and re.match(r"## (The question|Follow-up \d)", cell.source)]
    assert len(heads) == 8  # the question and its seven follow-ups
    for start, end in zip(heads, [*heads[1:], len(notebook.cells)], strict=True):
        section = notebook.cells[start:end]
        kinds = []
        for cell in section:
            if "predict" in cell.metadata.get("tags", []):
                kinds.append("predict")
            elif cell.cell_type == "markdown" and "<details>" in cell.source:
                kinds.append("answer")
            elif cell.cell_type == "code":
                kinds.append("experiment")
        first = {kind: kinds.index(kind) for kind in ("predict", "answer", "experiment")}
        assert first["predict"] < first["answer"] < first["experiment"], (
            f"{section[0].source.splitlines()[0]}: {kinds}")
