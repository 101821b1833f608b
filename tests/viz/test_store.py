"""The explorers' results on disk: a setting measured once is answered by a later kernel
without a run, the same result; anything doubtful is a miss, and a store that cannot
write never stops an explorer from answering."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest

pytest.importorskip("ipywidgets")

from minipar.train import TrainConfig  # noqa: E402
from minipar.viz import lattice, widgets  # noqa: E402
from minipar.viz import store as results  # noqa: E402
from minipar.viz.controls import make_control  # noqa: E402
from minipar.viz.explorer import Explorer  # noqa: E402
from minipar.viz.lattice import Measurements  # noqa: E402
from minipar.viz.runs import RunCache  # noqa: E402
from minipar.viz.stages import stages_picture  # noqa: E402

SMALL = TrainConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, micro_batch_size=2, steps=1)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The store on, in a fresh directory (the suite runs with it off: conftest.py)."""
    monkeypatch.setenv(results.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


class BarRuns(Measurements):
    name = "bars (tests)"

    def __init__(self, explorer):
        super().__init__(None)
        self.explorer = explorer

    def stores_results(self) -> bool:  # the test's code stands in for minipar's
        return True

    def measure(self, values):
        self.explorer.drawn.append(values["n"])
        return {"n": values["n"]}


class Bars(Explorer):
    """A cheap explorer that counts its measurements; stored as minipar's own are."""

    RUNS = BarRuns

    def __init__(self, prefetch: bool = False, **initial):
        self.drawn: list[int] = []
        self.measurements = self.RUNS(self)
        controls = {"n": make_control("dropdown", "n", [1, 2, 3], 2)}
        for name, value in initial.items():
            controls[name].value = value
        super().__init__(controls, prefetch=prefetch)

    def answer(self, values, result):
        n = result["n"]
        return [stages_picture([1] * n, [n] * n, 1)], f"n={n}"


def test_a_later_kernel_answers_a_stored_setting_without_measuring(cache_dir, monkeypatch):
    first = widgets.MemoryExplorer(SMALL, prefetch=False, dp=2)
    first.set(zero=1)
    shown = (first.pictures, first.status.value)

    def no_run(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(lattice, "train_report", no_run)  # a new kernel: nothing cached
    hits = first.measurements.store.hits
    later = widgets.MemoryExplorer(SMALL, prefetch=False, cache=RunCache(), dp=2, zero=1)
    assert (later.pictures, later.status.value) == shown
    assert later.measurements.store.hits == hits + 1 and later.error is None
    later.set(zero=0)  # the setting the first explorer opened on
    assert later.measurements.store.hits == hits + 2


def test_entries_are_json_named_by_the_fingerprint_never_pickles(cache_dir):
    Bars(n=2)
    [path] = (cache_dir / "explorers" / results.fingerprint()).glob("*.json")
    entry = json.loads(path.read_text(encoding="utf-8"))
    assert entry["result"] == {"n": 2} and entry["key"].startswith("('bars (tests)'")
    assert set(entry) == {"format", "key", "result"}


@pytest.mark.parametrize("damage", ["not json", "another key", "not a result",
                                    "no result field"])
def test_a_damaged_entry_is_a_miss_measured_again_and_rewritten(cache_dir, damage):
    Bars(n=2)
    [path] = (cache_dir / "explorers" / results.fingerprint()).glob("*.json")
    entry = json.loads(path.read_text(encoding="utf-8"))
    if damage == "not json":
        path.write_text("{truncated", encoding="utf-8")
    else:
        if damage == "another key":
            entry["key"] = entry["key"].replace("2", "3")
        elif damage == "not a result":
            entry["result"] = "aGVsbG8="
        else:
            del entry["result"]
        path.write_text(json.dumps(entry), encoding="utf-8")
    misses = results.result_store().misses
    again = Bars(n=2)
    assert again.drawn == [2] and again.measurements.store.misses == misses + 1
    assert Bars(n=2).drawn == []  # rewritten: the next kernel reads it


def test_the_fingerprint_changes_with_any_byte_of_the_package(tmp_path):
    package = pathlib.Path(results.__file__).resolve().parent.parent
    copy = tmp_path / "minipar"
    shutil.copytree(package / "viz", copy / "viz",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = results.package_digest(copy).hexdigest()
    (copy / "viz" / "__pycache__").mkdir(exist_ok=True)
    (copy / "viz" / "__pycache__" / "x.pyc").write_bytes(b"compiled")
    assert results.package_digest(copy).hexdigest() == before  # byte code: not the code
    target = copy / "viz" / "store.py"
    target.write_bytes(target.read_bytes() + b" ")
    assert results.package_digest(copy).hexdigest() != before


def test_a_directory_that_cannot_be_written_pauses_saving_not_the_explorer(
        tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory", encoding="utf-8")
    monkeypatch.setenv(results.CACHE_ENV, str(blocker))
    explorer = Bars(n=2)
    store = explorer.measurements.store
    explorer.set(n=3)
    assert explorer.status.value == "n=3" and explorer.drawn == [2, 3]
    assert "a file" in store.error and store.saves == 0
    blocker.unlink()  # the cause goes away: after the pause, saving resumes
    monkeypatch.setattr(results, "RETRY_SECONDS", 0.0)
    store._paused_until = 0.0
    explorer.set(n=1)
    assert store.error is None and store.saves == 1


def test_the_cache_deleted_while_a_kernel_runs_is_made_again(cache_dir):
    Bars(n=2)
    shutil.rmtree(cache_dir)
    explorer = Bars(n=3)
    assert explorer.measurements.store.error is None
    assert Bars(n=3).drawn == []  # stored again, in the directory made again
    assert not list(explorer.measurements.store.directory.glob("*.part"))


def test_off_and_measurements_by_other_code_store_nothing(cache_dir, monkeypatch):
    class ElsewhereRuns(BarRuns):
        stores_results = Measurements.stores_results  # the rule for code outside minipar

    class Elsewhere(Bars):
        RUNS = ElsewhereRuns

    assert Elsewhere(n=2).measurements.store is None
    monkeypatch.setenv(results.CACHE_ENV, "off")
    assert Bars(n=2).measurements.store is None and not cache_dir.exists()


def test_old_fingerprints_and_the_oldest_entries_are_dropped(cache_dir, monkeypatch):
    names = ["a" * 20, "b" * 20, "c" * 20, "d" * 20, "mine, not a fingerprint"]
    for age, name in enumerate(names):
        directory = cache_dir / "explorers" / name
        directory.mkdir(parents=True)
        os.utime(directory, (1e9 + age, 1e9 + age))
    monkeypatch.setattr(results, "MAX_ENTRIES", 2)
    store = Bars(n=1).measurements.store
    kept = sorted(d.name for d in (cache_dir / "explorers").iterdir())
    # KEEP_VERSIONS = 3 fingerprints, the newest; a directory of another name is left
    assert kept == sorted([results.fingerprint(), "c" * 20, "d" * 20, names[-1]])
    for n in (2, 3):  # three entries; the pruning runs every 100th save and at start
        Bars(n=n)
    store._prune_entries()
    assert len(list(store.directory.glob("*.json"))) == 2


def test_the_lattice_measured_in_the_background_is_stored_and_known_next_time(cache_dir):
    class Latticed(Bars):
        def lattice(self):
            return [{"n": n} for n in (1, 2, 3)]

    looked = Latticed(prefetch=True, n=2)
    assert looked.worker.wait_idle(30)
    looked.worker.cancel(looked)
    assert sorted(looked.drawn) == [1, 2, 3]  # shown, then the rest of the lattice
    keys = [looked.measurements.key({"n": n}) for n in (1, 2, 3)]
    assert looked.measurements.store.stored(keys) == set(keys)
    later = Latticed(prefetch=False, n=1)  # the next kernel: found, not measured
    later.set(n=3)
    assert later.drawn == []
