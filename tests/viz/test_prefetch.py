"""The explorers' background worker: urgent jobs first, spare jobs only when nothing else
runs; an explorer's lattice measured there, nearest settings first, is exactly what a
direct measurement gives."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("ipywidgets")

from minipar import distributed as dist  # noqa: E402
from minipar.viz import prefetch  # noqa: E402
from minipar.viz.controls import make_control  # noqa: E402
from minipar.viz.explorer import Explorer  # noqa: E402
from minipar.viz.lattice import Measurements  # noqa: E402
from minipar.viz.prefetch import Worker  # noqa: E402
from minipar.viz.stages import stages_picture  # noqa: E402


class BarRuns(Measurements):
    """A cheap measurement: n bars, recorded with the thread that measured them; n = 4
    is refused."""

    name = "bars (tests)"

    def __init__(self, explorer):
        super().__init__(None)
        self.explorer = explorer

    def measure(self, values):
        return self.explorer.measure(**values)


class Bars(Explorer):
    """A cheap explorer: n bars, wide or not; its lattice is every setting."""

    def __init__(self, prefetch: bool = False, **initial):
        self.drawn: list[tuple[tuple, str]] = []
        self.measurements = BarRuns(self)
        controls = {"n": make_control("dropdown", "n", [1, 2, 3, 4], 2),
                    "wide": make_control("check", "wide", value=False)}
        for name, value in initial.items():
            controls[name].value = value
        super().__init__(controls, prefetch=prefetch)

    def measure(self, n, wide):
        self.drawn.append(((n, wide), threading.current_thread().name))
        if n == 4:
            raise ValueError("four bars are refused")
        return {"n": n, "wide": wide}

    def answer(self, values, result):
        n = result["n"]
        return [stages_picture([1] * n, [n] * n, 1)], f"n={n}"

    def lattice(self):
        return [{"n": n, "wide": wide} for n in (1, 2, 3, 4) for wide in (False, True)]


def test_prefetch_is_off_outside_a_jupyter_kernel_unless_asked_for():
    assert not prefetch.in_kernel()  # pytest: the default, prefetch=None, means off
    assert Bars(n=2).worker is None
    asked = Bars(prefetch=True, n=1)
    assert asked.worker is prefetch.shared_worker()
    asked.worker.cancel(asked)


def test_the_lattice_is_measured_in_the_background_nearest_first():
    explorer = Bars(prefetch=True, n=2)
    assert explorer.worker is prefetch.shared_worker()
    assert explorer.worker.wait_idle(30)
    # every setting was measured on the worker thread, the nearest to n=2 first: one
    # control one option away, then two options away, then two controls
    measured = [values for values, _ in explorer.drawn]
    assert measured[0] == (2, False)  # the first picture, asked for
    assert set(measured[1:4]) == {(1, False), (3, False), (2, True)}
    assert set(measured[4:7]) == {(4, False), (1, True), (3, True)}
    assert measured[7:] == [(4, True)]
    assert {thread for _, thread in explorer.drawn[1:]} == {"minipar-explorer-worker"}
    assert explorer.progress.value == ""  # done: nothing left to say


def test_measured_settings_are_the_direct_answers_and_a_change_then_measures_nothing():
    explorer = Bars(prefetch=True, n=2)
    assert explorer.worker.wait_idle(30)
    drawn = len(explorer.drawn)
    explorer.controls["n"].value = 3  # ready: shown without measuring
    assert len(explorer.drawn) == drawn and explorer.status.value == "n=3"
    assert explorer.pictures == Bars(n=3).pictures
    explorer.controls["n"].value = 4  # the refusal is found again and shown
    assert explorer.error == "four bars are refused"
    explorer.worker.cancel(explorer)


def test_while_the_lattice_is_measured_the_explorer_says_how_far_it_got():
    class Slow(Bars):
        def measure(self, n, wide):
            time.sleep(0.05)
            return super().measure(n, wide)

    explorer = Slow(prefetch=True, n=1)
    said: list[str] = []
    explorer.progress.observe(lambda change: said.append(change["new"]), names="value")
    assert explorer.worker.wait_idle(30)
    assert "8 settings in the background" in said[0] and said[-1] == ""
    assert any("ready" in line for line in said[:-1])


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
    """n = 3 is a measured run that lasts until `release` is set; the lattice has it first."""

    def __init__(self, **initial):
        self.started, self.release = threading.Event(), threading.Event()
        super().__init__(prefetch=True, **initial)

    def lattice(self):
        return [{"n": 3, "wide": False}, *super().lattice()]

    def measure(self, n, wide):
        if n == 3:
            def rank():
                self.started.set()
                while not self.release.is_set():
                    dist.barrier()

            dist.launch(rank, 2)
        return super().measure(n, wide)


@pytest.mark.parametrize("asked, cancelled", [(3, 0), (1, 1)])
def test_a_change_cancels_the_setting_being_measured_unless_it_asks_for_it(asked, cancelled):
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


def test_a_worker_made_by_a_running_cell_counts_that_cell(monkeypatch):
    """The first explorer's cell makes the worker after its pre_run_cell has passed: the
    worker still counts it as running until its post_run_cell (IPython sets
    `displayhook.exec_result` while a cell's code runs), so no spare work starts during
    the rest of that cell."""
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

    def lattice(self):
        return []  # nothing measured unasked: every change is answered when asked

    def pending_status(self, values):
        return f"measuring n={values['n']} ..."

    def measure(self, n, wide):
        if n == 1:
            assert self.release.wait(10)
            if self.fail:
                raise RuntimeError("a bug in the drawing code")
        return super().measure(n, wide)


def test_a_slow_answer_shows_what_it_measures_until_the_pictures_come():
    explorer = SlowOne(n=2)
    said: list[str] = []
    explorer.status.observe(lambda change: said.append(change["new"]), names="value")
    threading.Timer(3 * prefetch.WAIT_NOTICE_S, explorer.release.set).start()
    explorer.controls["n"].value = 1
    # said until the answer came, counting the time so far
    assert len(said) >= 2 and said[-1] == "n=1"
    assert all("measuring n=1 ..." in line and "ms so far" in line for line in said[:-1])
    assert "still of the last setting" in said[0]
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
    assert not explorer.view.visible
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
