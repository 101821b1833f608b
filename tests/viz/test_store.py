"""The explorers' answers on disk: a setting answered once is answered by a later kernel
without a run or a drawing, byte for byte the same; anything doubtful is a miss, and a
store that cannot write never stops an explorer from answering."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import matplotlib as mpl
import pytest

pytest.importorskip("ipywidgets")

from matplotlib.figure import Figure  # noqa: E402

from minipar.viz import store as answers  # noqa: E402
from minipar.viz import widgets  # noqa: E402
from minipar.viz.agg import figure_png  # noqa: E402
from minipar.viz.controls import make_control  # noqa: E402
from minipar.viz.explorer import Explorer  # noqa: E402
from minipar.viz.runs import RunCache  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The store on, in a fresh directory (the suite runs with it off: conftest.py)."""
    monkeypatch.setenv(answers.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


class Bars(Explorer):
    """A cheap explorer that counts its drawings; stored as minipar's own are."""

    def __init__(self, **initial):
        self.drawn: list[int] = []
        controls = {"n": make_control("dropdown", "n", [1, 2, 3], 2)}
        for name, value in initial.items():
            controls[name].value = value
        super().__init__(controls, prefetch=False)

    def stores_answers(self) -> bool:  # the test's code stands in for minipar's
        return True

    def draw(self, n):
        self.drawn.append(n)
        fig = Figure(figsize=(2, 1))
        fig.subplots().bar(range(n), range(1, n + 1))
        return [fig], f"n={n}"


def test_a_later_kernel_answers_a_stored_setting_without_measuring_or_drawing(
        cache_dir, monkeypatch):
    first = widgets.PipelineExplorer(prefetch=False, pp=2, micro_batches=2)
    first.set(schedule="gpipe")
    shown = ([image.value for image in first.images], first.status.value)

    def no_run(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(widgets, "pipeline_step", no_run)  # a new kernel: nothing cached
    hits = first.store.hits
    later = widgets.PipelineExplorer(prefetch=False, cache=RunCache(), pp=2,
                                     micro_batches=2, schedule="gpipe")
    assert ([image.value for image in later.images], later.status.value) == shown
    assert later.store.hits == hits + 1 and later.error is None
    later.set(schedule="1f1b")  # the setting the first explorer opened on
    assert later.store.hits == hits + 2
    # Its Figures are drawn only when asked for; they are the ones the PNGs show.
    monkeypatch.undo()
    monkeypatch.setenv(answers.CACHE_ENV, str(cache_dir))
    assert [figure_png(fig) for fig in later.figures] == [image.value
                                                          for image in later.images]


def test_entries_are_json_named_by_the_fingerprint_never_pickles(cache_dir):
    Bars(n=2)
    [path] = (cache_dir / "explorers" / answers.fingerprint()).glob("*.json")
    entry = json.loads(path.read_text(encoding="utf-8"))
    assert entry["message"] == "n=2" and entry["key"].startswith("('picture', 'Bars'")
    assert set(entry) == {"format", "key", "style", "message", "pngs"}


@pytest.mark.parametrize("damage", ["not json", "another key", "not a png", "no pngs field"])
def test_a_damaged_entry_is_a_miss_drawn_again_and_rewritten(cache_dir, damage):
    Bars(n=2)
    [path] = (cache_dir / "explorers" / answers.fingerprint()).glob("*.json")
    entry = json.loads(path.read_text(encoding="utf-8"))
    if damage == "not json":
        path.write_text("{truncated", encoding="utf-8")
    else:
        if damage == "another key":
            entry["key"] = entry["key"].replace("2", "3")
        elif damage == "not a png":
            entry["pngs"] = ["aGVsbG8="]  # base64 of b"hello"
        else:
            del entry["pngs"]
        path.write_text(json.dumps(entry), encoding="utf-8")
    misses = answers.answer_store().misses
    again = Bars(n=2)
    assert again.drawn == [2] and again.store.misses == misses + 1
    assert Bars(n=2).drawn == []  # rewritten: the next kernel reads it


def test_another_matplotlib_style_is_another_entry(cache_dir):
    Bars(n=2)
    with mpl.rc_context({"font.size": 13}):
        assert Bars(n=2).drawn == [2]
        assert Bars(n=2).drawn == []
    assert Bars(n=2).drawn == []  # the first style's entry is still there


def test_the_fingerprint_changes_with_any_byte_of_the_package(tmp_path):
    package = pathlib.Path(answers.__file__).resolve().parent.parent
    copy = tmp_path / "minipar"
    shutil.copytree(package / "viz", copy / "viz",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = answers.package_digest(copy).hexdigest()
    (copy / "viz" / "__pycache__").mkdir(exist_ok=True)
    (copy / "viz" / "__pycache__" / "x.pyc").write_bytes(b"compiled")
    assert answers.package_digest(copy).hexdigest() == before  # byte code: not the code
    target = copy / "viz" / "store.py"
    target.write_bytes(target.read_bytes() + b" ")
    assert answers.package_digest(copy).hexdigest() != before


def test_a_directory_that_cannot_be_written_pauses_saving_not_the_explorer(
        tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory", encoding="utf-8")
    monkeypatch.setenv(answers.CACHE_ENV, str(blocker))
    explorer = Bars(n=2)
    explorer.set(n=3)
    assert explorer.status.value == "n=3" and explorer.drawn == [2, 3]
    assert "a file" in explorer.store.error and explorer.store.saves == 0
    blocker.unlink()  # the cause goes away: after the pause, saving resumes
    monkeypatch.setattr(answers, "RETRY_SECONDS", 0.0)
    explorer.store._paused_until = 0.0
    explorer.set(n=1)
    assert explorer.store.error is None and explorer.store.saves == 1


def test_the_cache_deleted_while_a_kernel_runs_is_made_again(cache_dir):
    Bars(n=2)
    shutil.rmtree(cache_dir)
    explorer = Bars(n=3)
    assert explorer.store.error is None
    assert Bars(n=3).drawn == []  # stored again, in the directory made again
    assert not list(explorer.store.directory.glob("*.part"))


def test_a_restyle_gives_new_pictures_even_where_a_figure_is_shared(cache_dir):
    # The traffic explorer's heatmaps are shared by its two bar views (cached_figure):
    # after a restyle, neither the RunCache nor the store may hand back the old style.
    config = widgets.EXPLORER_CONFIG.replace(n_layer=2, dp=2, tp=1, pp=1)
    explorer = widgets.TrafficExplorer(config, prefetch=False, dp=2, tp=1, pp=1, zero=0,
                                       grad_accum_steps=1, gpus_per_node=2)
    plain = explorer.images[0].value
    with mpl.rc_context({"axes.edgecolor": "red", "xtick.color": "red"}):
        explorer.set(by="op")
        red = explorer.images[0].value
        assert red != plain
        explorer.set(by="group")  # seen before, in the old style: drawn again
        assert explorer.images[0].value == red
        explorer.set(by="op")
        fresh = widgets.TrafficExplorer(config, prefetch=False, cache=RunCache(), dp=2, tp=1,
                                        pp=1, zero=0, grad_accum_steps=1, gpus_per_node=2,
                                        by="op")
        assert fresh.images[0].value == red  # from the store, in this style
    explorer.set(by="group")
    assert explorer.images[0].value == plain


def test_off_and_explorers_drawn_by_other_code_store_nothing(cache_dir, monkeypatch):
    class Elsewhere(Bars):
        stores_answers = Explorer.stores_answers  # the rule for code outside minipar

    assert Elsewhere(n=2).store is None
    monkeypatch.setenv(answers.CACHE_ENV, "off")
    assert Bars(n=2).store is None and not cache_dir.exists()


def test_old_fingerprints_and_the_oldest_entries_are_dropped(cache_dir, monkeypatch):
    names = ["a" * 20, "b" * 20, "c" * 20, "d" * 20, "mine, not a fingerprint"]
    for age, name in enumerate(names):
        directory = cache_dir / "explorers" / name
        directory.mkdir(parents=True)
        os.utime(directory, (1e9 + age, 1e9 + age))
    monkeypatch.setattr(answers, "MAX_ENTRIES", 2)
    store = Bars(n=1).store
    kept = sorted(d.name for d in (cache_dir / "explorers").iterdir())
    # KEEP_VERSIONS = 3 fingerprints, the newest; a directory of another name is left
    assert kept == sorted([answers.fingerprint(), "c" * 20, "d" * 20, names[-1]])
    for n in (2, 3):  # three entries; the pruning runs every 100th save and at start
        Bars(n=n)
    store._prune_entries()
    assert len(list(store.directory.glob("*.json"))) == 2


def test_what_the_worker_prepares_is_stored_and_found_first_next_time(cache_dir):
    class Prefetched(Bars):
        def __init__(self, prefetch: bool, **initial):
            self.drawn = []
            controls = {"n": make_control("dropdown", "n", [1, 2, 3], 2)}
            for name, value in initial.items():
                controls[name].value = value
            Explorer.__init__(self, controls, prefetch=prefetch)

        def prefetch_cost(self, values):
            return {1: 5.0, 3: 1.0}.get(values["n"], 1.0)  # 3 is the cheaper neighbour

    looked = Prefetched(prefetch=True, n=2)
    assert looked.worker.wait_idle(30)
    looked.worker.cancel(looked)
    assert sorted(looked.drawn) == [1, 2, 3]  # shown, then both neighbours prepared
    keys = [looked.picture_key({"n": n}) for n in (1, 2, 3)]
    assert looked.store.stored(keys) == set(keys)

    class Recorder:  # stands in for the worker: the order jobs are handed to it
        def prefetch(self, owner, jobs):
            self.order = [key for key, _ in jobs]

    looked.store._path(keys[2], answers.style_digest()).unlink()  # only n=1 is on disk now
    later = Prefetched(prefetch=False, n=2)  # the next kernel
    later.worker = Recorder()
    later._prefetch_neighbours(later.values())
    # n=1, the dearer one to draw, is a file to read: it goes first.
    assert later.worker.order == [keys[0], keys[2]]
