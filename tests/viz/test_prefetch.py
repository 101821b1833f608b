"""The explorers' background worker: urgent jobs first, spare jobs only when nothing else
runs, and what it prepares is exactly what a direct draw shows."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("ipywidgets")

from matplotlib.figure import Figure  # noqa: E402

from minipar import distributed as dist  # noqa: E402
from minipar.viz import prefetch  # noqa: E402
from minipar.viz.controls import make_control  # noqa: E402
from minipar.viz.explorer import Explorer  # noqa: E402
from minipar.viz.prefetch import Worker  # noqa: E402


class Bars(Explorer):
    """A cheap explorer: n bars; n = 4 is refused; records where each draw ran."""

    def __init__(self, prefetch: bool = False, **initial):
        self.drawn: list[tuple[tuple, str]] = []
        controls = {"n": make_control("dropdown", "n", [1, 2, 3, 4], 2),
                    "wide": make_control("check", "wide", value=False)}
        for name, value in initial.items():
            controls[name].value = value
        super().__init__(controls, prefetch=prefetch)

    def draw(self, n, wide):
        self.drawn.append(((n, wide), threading.current_thread().name))
        if n == 4:
            raise ValueError("four bars are refused")
        fig = Figure(figsize=(3 if wide else 2, 1))
        ax = fig.subplots()
        ax.bar(range(n), range(1, n + 1))
        ax.set_title(f"{n} bars", fontsize=7)
        return [fig], f"n={n}"


def test_prefetch_is_off_outside_a_jupyter_kernel_unless_asked_for():
    assert not prefetch.in_kernel()  # pytest: the default, prefetch=None, means off
    assert Bars(n=2).worker is None
    asked = Bars(prefetch=True, n=1)
    assert asked.worker is prefetch.shared_worker()
    asked.worker.cancel(asked)


def test_neighbours_are_one_control_change_away_nearest_option_first():
    explorer = Bars(n=2)
    assert explorer.neighbours(explorer.values()) == [
        {"n": 1, "wide": False}, {"n": 3, "wide": False},  # the adjacent options
        {"n": 2, "wide": True},                            # the check box toggled
        {"n": 4, "wide": False}]                           # two options away


def test_neighbours_are_queued_cheapest_first_and_unwanted_ones_left_out():
    class Priced(Bars):
        def prefetch_cost(self, values):
            return None if values["wide"] else {1: 5.0, 3: 0.0, 4: 1.0}[values["n"]]

    class Recorder:
        def prefetch(self, owner, jobs):
            self.keys = [key for key, _ in jobs]

    explorer = Priced(n=2)
    explorer.worker = recorder = Recorder()
    explorer._prefetch_neighbours(explorer.values())
    assert recorder.keys == [explorer.picture_key({"n": n, "wide": False}) for n in (3, 4, 1)]


def test_a_sweep_of_one_control_prepares_its_next_step_first_however_costly():
    class Priced(Bars):
        def prefetch_cost(self, values):
            return {1: 0.0, 2: 1.0, 3: 9.0, 4: 0.5}[values["n"]] + values["wide"]

    class Recorder:
        def prefetch(self, owner, jobs):
            self.keys = [key for key, _ in jobs]

        def run_now(self, job, key=None, on_wait=None):
            return job()

    explorer = Priced(n=1)
    explorer.worker = recorder = Recorder()
    explorer.controls["n"].value = 2  # 1 -> 2: the reader sweeps n upwards ...
    key = explorer.picture_key
    # ... so 3 first, then the cheapest (n=1 was shown: it is cached already)
    assert recorder.keys == [key({"n": 3, "wide": False}), key({"n": 4, "wide": False}),
                             key({"n": 2, "wide": True})]
    explorer.controls["wide"].value = True  # a check box: no sweep, cheapest first
    assert recorder.keys[:2] == [key({"n": 1, "wide": True}), key({"n": 4, "wide": True})]
    assert explorer.ahead({"n": 1, "wide": False}, {"n": 2, "wide": True}) is None  # 2 moved
    assert explorer.ahead({"n": 3, "wide": False}, {"n": 4, "wide": False}) is None  # the end
    assert explorer.ahead({"n": 3, "wide": False}, {"n": 2, "wide": False}) == {
        "n": 1, "wide": False}  # downwards


def test_prefetched_pictures_are_the_direct_draws_and_a_change_then_draws_nothing():
    explorer = Bars(prefetch=True, n=2)
    assert explorer.worker is prefetch.shared_worker()
    assert explorer.worker.wait_idle(30)
    # every neighbour was drawn on the worker thread; the refused one is remembered
    assert {values for values, _ in explorer.drawn} == {(2, False), (1, False), (3, False),
                                                        (2, True), (4, False)}
    assert {thread for _, thread in explorer.drawn} == {"minipar-explorer-worker"}
    assert explorer._refused == {explorer.picture_key({"n": 4, "wide": False})}
    drawn = len(explorer.drawn)
    explorer.controls["n"].value = 3  # ready: shown without drawing
    assert len(explorer.drawn) == drawn and explorer.status.value == "n=3"
    assert bytes(explorer.images[0].value) == bytes(Bars(n=3).images[0].value)
    explorer.controls["n"].value = 4  # the refusal is computed again and shown
    assert explorer.error == "four bars are refused"
    explorer.worker.cancel(explorer)


def _blocked_worker():
    """A worker busy with a spare job until the returned event is set."""
    worker, release, order = Worker(), threading.Event(), []
    worker.prefetch("blocker", [("block", lambda: (release.wait(10), order.append("block")))])
    deadline = time.monotonic() + 10
    while not worker.working and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.working
    return worker, release, order


def test_an_urgent_job_goes_before_every_waiting_spare_one_and_new_wishes_replace_old():
    worker, release, order = _blocked_worker()
    worker.prefetch("explorer", [("a", lambda: order.append("a"))])
    worker.prefetch("explorer", [("b", lambda: order.append("b")),
                                 ("c", lambda: order.append("c"))])  # "a" is dropped
    answer = []
    caller = threading.Thread(target=lambda: answer.append(
        worker.run_now(lambda: order.append("urgent") or 42)))
    caller.start()
    deadline = time.monotonic() + 10  # (not a fixed sleep: a loaded machine may be slow
    while not worker._urgent and time.monotonic() < deadline:  # to start the caller)
        time.sleep(0.005)
    assert worker._urgent, "the caller never queued its urgent job"
    release.set()
    caller.join(10)
    assert worker.wait_idle(10)
    assert answer == [42] and order == ["block", "urgent", "b", "c"]
    with pytest.raises(ZeroDivisionError):  # an urgent job's error is its caller's
        worker.run_now(lambda: 1 / 0)


def test_the_explorer_that_asked_last_is_prepared_for_first():
    worker, release, order = _blocked_worker()
    worker.prefetch("explorer higher up", [("a1", lambda: order.append("a1")),
                                           ("a2", lambda: order.append("a2"))])
    worker.prefetch("explorer in use", [("b1", lambda: order.append("b1"))])
    release.set()
    assert worker.wait_idle(10)
    assert order == ["block", "b1", "a1", "a2"]  # then the others', in the idle time left


def test_spare_work_waits_while_a_notebook_cell_runs():
    worker, release, order = _blocked_worker()
    release.set()
    assert worker.wait_idle(10)
    worker.cell_started()  # IPython's pre_run_cell
    worker.prefetch("explorer", [("a", lambda: order.append("a"))])
    time.sleep(2 * prefetch.IDLE_SECONDS)
    assert order == ["block"] and worker.pending() == 1
    worker.cell_finished()  # post_run_cell: after IDLE_SECONDS of quiet, the spare job
    assert worker.wait_idle(10)
    assert order == ["block", "a"]


def test_a_cell_that_starts_during_a_spare_job_waits_for_it():
    worker, release, order = _blocked_worker()
    threading.Timer(0.2, release.set).start()
    worker.cell_started()  # returns once the spare job in progress is done
    assert order == ["block"] and not worker.working
    worker.cell_finished()


def test_prepared_pictures_never_shown_are_forgotten_once_the_reader_moves_on():
    class Forgetful(Bars):
        KEEP_UNSHOWN = 0

    explorer = Forgetful(prefetch=True, n=1)
    assert explorer.worker.wait_idle(30)
    near_one = {explorer.picture_key({"n": 2, "wide": False}),
                explorer.picture_key({"n": 1, "wide": True})}
    assert near_one <= set(explorer._unshown) and all(k in explorer.cache for k in near_one)
    explorer.controls["n"].value = 2  # shown: kept; n=1 wide is no neighbour of n=2 ...
    assert explorer.worker.wait_idle(30)
    shown, left = explorer.picture_key({"n": 2, "wide": False}), \
        explorer.picture_key({"n": 1, "wide": True})
    assert shown in explorer.cache and shown not in explorer._unshown
    assert left not in explorer.cache  # ... so it was discarded
    assert explorer.picture_key({"n": 2, "wide": True}) in explorer.cache  # a neighbour
    explorer.worker.cancel(explorer)


def _spare_run(worker, key, rounds=10**6):
    """Queue a spare job whose measured run (2 ranks exchanging barriers) lasts `rounds`
    barriers; returns (ranks started, what the job returned)."""
    started, outcome = threading.Event(), []

    def rank():
        started.set()
        for _ in range(rounds):
            dist.barrier()

    worker.prefetch("explorer", [(key, lambda: outcome.append(dist.launch(rank, 2)))])
    assert started.wait(10)
    return outcome


def test_an_urgent_job_cancels_the_spare_run_in_progress_and_goes_first():
    worker, release, order = _blocked_worker()
    release.set()
    assert worker.wait_idle(10)
    outcome = _spare_run(worker, "a setting nobody asked for")
    assert worker.run_now(lambda: 42, "the setting asked for") == 42
    assert worker.wait_idle(10)
    assert worker.spare_cancelled == 1 and outcome == []  # its run was thrown away


def test_an_urgent_job_for_the_picture_being_prepared_waits_for_it():
    worker, release, order = _blocked_worker()
    release.set()
    assert worker.wait_idle(10)
    outcome = _spare_run(worker, "this setting", rounds=300)
    assert worker.run_now(lambda: "drawn", "this setting") == "drawn"
    assert worker.spare_cancelled == 0 and outcome == [[None, None]]  # it ran to the end


def test_a_cell_that_starts_during_a_spare_run_cancels_it():
    worker, release, order = _blocked_worker()
    release.set()
    assert worker.wait_idle(10)
    outcome = _spare_run(worker, "a neighbour")
    worker.cell_started()
    assert not worker.working and worker.spare_cancelled == 1 and outcome == []
    worker.cell_finished()


class SlowThree(Bars):
    """n = 3 is a measured run that lasts until `release` is set; it is prepared first."""

    def __init__(self, **initial):
        self.started, self.release = threading.Event(), threading.Event()
        super().__init__(prefetch=True, **initial)

    def prefetch_cost(self, values):
        return 0.0 if values == {"n": 3, "wide": False} else 1.0

    def draw(self, n, wide):
        if n == 3:
            def rank():
                self.started.set()
                while not self.release.is_set():
                    dist.barrier()

            dist.launch(rank, 2)
        return super().draw(n, wide)


@pytest.mark.parametrize("asked, cancelled", [(3, 0), (1, 1)])
def test_a_change_cancels_the_neighbour_being_measured_unless_it_asks_for_it(asked, cancelled):
    explorer = SlowThree(n=2)
    assert explorer.started.wait(10)  # the worker is measuring n = 3
    before = explorer.worker.spare_cancelled
    if asked == 3:  # waiting for the run in progress is the answer: let it finish
        threading.Timer(0.2, explorer.release.set).start()
    explorer.controls["n"].value = asked
    explorer.release.set()
    assert explorer.status.value == f"n={asked}" and explorer.error is None
    assert explorer.worker.spare_cancelled - before == cancelled
    if asked == 3:  # measured once, by the spare job the answer waited for
        assert [values for values, _ in explorer.drawn].count((3, False)) == 1
    explorer.worker.cancel(explorer)
    assert explorer.worker.wait_idle(30)


def _full_collections_paused() -> bool:
    import gc

    return gc.get_threshold()[2] == 2**31 - 1


def test_once_quiet_after_an_answer_the_worker_collects_the_garbage_before_spare_work():
    """The figures an answer leaves are reference cycles only a full collection frees:
    from the moment an answer is asked for, Python's full collections are paused (the
    young ones go on); once the process is quiet the worker collects, before the spare
    jobs, and restores Python's thresholds (prefetch.py's docstring)."""
    import gc

    before = gc.get_threshold()
    order: list[str] = []
    worker = Worker()
    worker._collect_garbage = lambda: order.append("collect")
    assert worker.run_now(lambda: order.append("answer") or _full_collections_paused())
    worker.prefetch("explorer", [("a", lambda: order.append("a"))])
    assert _full_collections_paused()  # the answer's garbage waits for the quiet time
    assert worker.wait_idle(10)
    assert order == ["answer", "collect", "a"] and worker.collections == 1
    assert gc.get_threshold() == before and gc.isenabled()
    worker.prefetch("explorer", [("b", lambda: order.append("b"))])
    assert worker.wait_idle(10)
    assert order[-1] == "b" and worker.collections == 1  # spare jobs alone: Python's own


def test_a_pause_never_outlasts_max_pause_seconds(monkeypatch):
    """Answers that come faster than the quiet time (a dragged slider) would keep the
    full collections paused for good: past MAX_PAUSE_SECONDS the next answer runs with
    Python's own thresholds, and the one after it starts a new pause."""
    import gc

    monkeypatch.setattr(prefetch, "MAX_PAUSE_SECONDS", 0.2)
    # Quiet time far above the answers' spacing: a loaded machine that stalls this loop
    # for a few tenths of a second must not let the idle collection end the pause.
    monkeypatch.setattr(prefetch, "IDLE_SECONDS", 1.0)
    before = gc.get_threshold()
    worker = Worker()
    worker._collect_garbage = lambda: None
    paused = [worker.run_now(_full_collections_paused)]
    deadline = time.monotonic() + 10
    while (False not in paused[:-1]) and time.monotonic() < deadline:
        paused.append(worker.run_now(_full_collections_paused))  # an answer every 0.05 s
        time.sleep(0.05)
    assert paused[0] and not all(paused)
    assert paused[paused.index(False) + 1]  # and then a new pause
    assert worker.wait_idle(10) and gc.get_threshold() == before


def test_inside_a_cell_an_answer_keeps_pythons_collections_and_the_worker_waits():
    order: list[str] = []
    worker = Worker()
    worker._collect_garbage = lambda: order.append("collect")
    worker.cell_started()  # "Run All", or explorer.set(...) in a cell
    assert worker.run_now(_full_collections_paused) is False
    time.sleep(2 * prefetch.IDLE_SECONDS)
    assert order == []  # no collection while the cell runs
    worker.cell_finished()
    assert worker.wait_idle(10)
    assert order == ["collect"] and not _full_collections_paused()


def test_a_cell_that_starts_restores_pythons_collections_and_a_kernel_without_keeps_it_off():
    import gc

    before = gc.get_threshold()
    worker = Worker()
    worker._collect_garbage = lambda: None
    worker.run_now(lambda: None)
    assert _full_collections_paused()
    worker.cell_started()  # before the quiet time: the cell runs with Python's own
    assert gc.get_threshold() == before
    worker.cell_finished()
    assert worker.wait_idle(10)
    gc.disable()  # a kernel that turned the collector off
    try:
        with pytest.raises(ZeroDivisionError):
            worker.run_now(lambda: 1 / 0)
        assert worker.wait_idle(10) and worker.collections == 2
        assert not gc.isenabled() and gc.get_threshold() == before
    finally:
        gc.enable()


def test_a_worker_made_by_a_running_cell_counts_that_cell(monkeypatch):
    """The first explorer's cell makes the worker after its pre_run_cell has passed: the
    worker still counts it as running until its post_run_cell (IPython sets
    `displayhook.exec_result` while a cell's code runs), so no spare work starts and
    no collection is paused during the rest of that cell."""
    IPython = pytest.importorskip("IPython")

    class Events:
        def __init__(self):
            self.callbacks: dict[str, list] = {}

        def register(self, name, callback):
            self.callbacks.setdefault(name, []).append(callback)

    class Shell:
        events = Events()
        displayhook = type("DisplayHook", (), {"exec_result": object()})()

    shell = Shell()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    worker = Worker()
    assert worker._cells_running == 1
    # A silent execution (a kernel's silent request, a startup file) sets exec_result
    # too but fires neither pre_run_cell nor post_run_cell: not counted.
    silent = type("Info", (), {"silent": True})()
    shell.displayhook.exec_result = type("Result", (), {"info": silent})()
    assert Worker()._cells_running == 0
    worker.prefetch("explorer", [("a", lambda: None)])
    time.sleep(2 * prefetch.IDLE_SECONDS)
    assert worker.pending() == 1  # the cell runs on
    for callback in shell.events.callbacks["post_run_cell"]:
        callback(None)
    assert worker.wait_idle(10) and worker.pending() == 0


def test_an_answer_that_takes_a_while_says_so_at_once_and_a_quick_one_does_not(
        monkeypatch):
    worker = Worker()
    said: list[str] = []
    monkeypatch.setattr(prefetch, "WAIT_NOTICE_S", 2.0)  # (however busy the machine)
    assert worker.run_now(lambda: "quick", on_wait=lambda: said.append("waiting")) == "quick"
    assert said == []
    monkeypatch.setattr(prefetch, "WAIT_NOTICE_S", 0.05)

    def slow():
        time.sleep(0.5)
        said.append("done")
        return "slow"

    assert worker.run_now(slow, on_wait=lambda: said.append("waiting")) == "slow"
    assert said == ["waiting", "done"]  # said while the job ran, on the caller's thread

    def times_out():
        raise TimeoutError("the job's own")

    said.clear()
    with pytest.raises(TimeoutError, match="the job's own"):
        worker.run_now(times_out, on_wait=lambda: said.append("waiting"))
    assert worker.wait_idle(10) and said == []  # its error, not a wait


class SlowOne(Bars):
    """n = 1 takes until `release` is set (or raises, with `fail`)."""

    def __init__(self, **initial):
        self.release, self.fail = threading.Event(), False
        super().__init__(prefetch=True, **initial)

    def prefetch_cost(self, values):
        return None  # nothing prepared unasked: every change is answered when asked

    def pending_status(self, values):
        return f"measuring n={values['n']} ..."

    def draw(self, n, wide):
        if n == 1:
            assert self.release.wait(10)
            if self.fail:
                raise RuntimeError("a bug in the drawing code")
        return super().draw(n, wide)


def test_a_slow_answer_shows_what_it_measures_until_the_pictures_come():
    explorer = SlowOne(n=2)
    said: list[str] = []
    explorer.status.observe(lambda change: said.append(change["new"]), names="value")
    threading.Timer(3 * prefetch.WAIT_NOTICE_S, explorer.release.set).start()
    explorer.controls["n"].value = 1
    assert len(said) == 2 and "measuring n=1 ..." in said[0]
    assert "still of the last setting" in said[0] and said[1] == "n=1"
    explorer.worker.cancel(explorer)


def test_an_answer_that_fails_says_so_instead_of_measuring_forever():
    explorer = SlowOne(n=2)
    explorer.fail = True
    threading.Timer(3 * prefetch.WAIT_NOTICE_S, explorer.release.set).start()
    with pytest.raises(RuntimeError, match="a bug in the drawing code"):
        explorer.controls["n"].value = 1
    assert "could not be drawn: RuntimeError: a bug in the drawing code" in (
        explorer.status.value)
    assert explorer.error is not None  # and n = 2's pictures are not shown under n = 1
    assert explorer._pictures.layout.visibility == "hidden"
    explorer.worker.cancel(explorer)


def test_a_status_line_that_fails_never_costs_the_answer_it_announces():
    worker = Worker()

    def broken_status():
        raise KeyError("a bug in pending_status")

    def slow():
        time.sleep(0.3)
        return "the answer"

    assert worker.run_now(slow, on_wait=broken_status) == "the answer"


def test_after_a_refusal_the_measuring_line_does_not_speak_of_pictures_below():
    explorer = SlowOne(n=2)
    explorer.controls["n"].value = 4  # refused: the pictures are hidden
    assert explorer.error is not None
    said: list[str] = []
    explorer.status.observe(lambda change: said.append(change["new"]), names="value")
    threading.Timer(3 * prefetch.WAIT_NOTICE_S, explorer.release.set).start()
    explorer.controls["n"].value = 1
    assert "measuring n=1 ..." in said[0] and "pictures below" not in said[0]
    explorer.worker.cancel(explorer)
