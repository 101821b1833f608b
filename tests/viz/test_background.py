"""An explorer's change from the browser is answered on the worker thread, and a later
change supersedes it: the reader waits for the setting they asked for last, alone."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("ipywidgets")

from minipar import distributed as dist  # noqa: E402
from minipar.viz import explorer as explorer_module  # noqa: E402
from minipar.viz.background import LatestAnswer  # noqa: E402
from minipar.viz.controls import make_control  # noqa: E402
from minipar.viz.explorer import Explorer  # noqa: E402
from minipar.viz.lattice import Measurements  # noqa: E402
from minipar.viz.prefetch import Worker  # noqa: E402
from minipar.viz.stages import stages_picture  # noqa: E402


class GatedRuns(Measurements):
    name = "gated (tests)"

    def __init__(self, explorer):
        super().__init__(None)
        self.explorer = explorer

    def measure(self, values):
        return self.explorer.measure(**values)


class Gated(Explorer):
    """n bars, answered in the background; a measurement of n waits for `gates[n]` (open
    for n = 2, the first picture); n = 4 is refused by the measurement (check lets it
    through), n = 5 a bug. Nothing is measured unasked (no lattice): every measurement
    is one a change asked for."""

    RUNS = GatedRuns

    def __init__(self):
        self.drawn: list[tuple[int, bool]] = []
        self.gates = {n: threading.Event() for n in range(1, 6)}
        self.gates[2].set()
        self.measurements = self.RUNS(self)
        controls = {"n": make_control("dropdown", "n", [1, 2, 3, 4, 5], 2),
                    "wide": make_control("check", "wide", value=False)}
        super().__init__(controls, prefetch=True)
        self.background = True

    def measure(self, n, wide):
        assert self.gates[n].wait(10)
        self.drawn.append((n, wide))
        if n == 4:
            raise ValueError("four bars are refused")
        if n == 5:
            raise ZeroDivisionError("a bug in the drawing")
        return {"n": n, "wide": wide}

    def answer(self, values, result):
        n = result["n"]
        return [stages_picture([1] * n, [n] * n, 1)], f"n={n} wide={result['wide']}"


def _settle(explorer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while explorer._later.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not explorer._later.pending
    assert explorer.worker.wait_idle(timeout)


def test_the_first_picture_is_drawn_before_the_cell_goes_on():
    explorer = Gated()
    assert explorer.draws == 1 and explorer.status.value == "n=2 wide=False"
    assert explorer.drawn == [(2, False)]


def test_a_change_returns_at_once_says_what_it_measures_and_shows_the_answer_when_ready():
    explorer = Gated()
    explorer.controls["n"].value = 3  # returns with its draw held by the gate
    assert explorer.draws == 1 and explorer.drawn == [(2, False)]
    assert "measuring" in explorer.status.value
    assert "still of the last setting" in explorer.status.value
    explorer.gates[3].set()
    _settle(explorer)
    assert explorer.draws == 2 and explorer.status.value == "n=3 wide=False"
    assert explorer.error is None and explorer._shown_values == {"n": 3, "wide": False}
    assert explorer.view.pictures == explorer.pictures and explorer.pictures


def test_changes_in_a_row_compute_the_answer_in_progress_and_the_last_one_only():
    explorer = Gated()
    explorer.controls["n"].value = 1  # its draw starts, held by the gate
    explorer.controls["n"].value = 3  # never computed: superseded before it started
    explorer.controls["wide"].value = True
    explorer.gates[1].set()
    explorer.gates[3].set()
    _settle(explorer)
    assert explorer.drawn == [(2, False), (1, False), (3, True)]
    assert explorer.status.value == "n=3 wide=True" and explorer.draws == 2  # shown once
    # what the superseded answer finished is kept: going back to it is instant
    assert explorer.measurements.key({"n": 1, "wide": False}) in explorer.cache
    explorer.set(n=1, wide=False)
    assert explorer.status.value == "n=1 wide=False" and explorer.draws == 3


def test_a_setting_ready_now_is_shown_at_once_and_the_answer_in_progress_is_dropped():
    explorer = Gated()
    explorer.controls["n"].value = 1  # held by its gate
    explorer.controls["n"].value = 2  # the first picture's setting: in the cache
    assert explorer.status.value == "n=2 wide=False" and explorer.draws == 2
    explorer.gates[1].set()
    _settle(explorer)
    assert explorer.status.value == "n=2 wide=False" and explorer.draws == 2  # not n=1


def test_a_refusal_or_a_bug_found_on_the_worker_is_said_in_the_status_line():
    explorer = Gated()
    explorer.gates[4].set()
    explorer.controls["n"].value = 4
    _settle(explorer)
    assert explorer.error == "four bars are refused"
    assert "cannot run this layout" in explorer.status.value
    assert not explorer.view.visible
    explorer.gates[5].set()
    explorer.controls["n"].value = 5  # raised on the worker thread: nobody to raise it to
    _settle(explorer)
    assert explorer.error == "ZeroDivisionError: a bug in the drawing"
    assert "could not be drawn" in explorer.status.value


class Measured(Gated):
    """n = 1 is a measured run that lasts until cancelled (or 10 s), unless `release` is
    set before it starts."""

    def __init__(self):
        self.release, self.runs = threading.Event(), 0
        super().__init__()

    def measure(self, n, wide):
        if n == 1:
            self.run_started, self.runs = threading.Event(), self.runs + 1
            released = self.release.is_set()

            def rank():
                self.run_started.set()
                deadline = time.monotonic() + 10
                while not released and time.monotonic() < deadline:
                    dist.barrier()

            dist.launch(rank, 2)
        return super().measure(n, wide)


def test_a_later_change_cancels_the_run_in_progress():
    explorer = Measured()
    explorer.gates[1].set()
    explorer.gates[3].set()
    explorer.controls["n"].value = 1
    while not hasattr(explorer, "run_started"):
        time.sleep(0.005)
    assert explorer.run_started.wait(10)
    explorer.controls["n"].value = 3
    _settle(explorer)
    assert explorer.status.value == "n=3 wide=False"
    assert (1, False) not in explorer.drawn  # stopped inside its run, before its figures
    assert explorer.measurements.key({"n": 1, "wide": False}) not in explorer.cache


def test_by_default_only_a_change_from_the_browser_is_answered_in_the_background(
        monkeypatch):
    explorer = Gated()
    explorer.background = None  # the default after the first picture
    assert not explorer._background()  # pytest is not a kernel
    monkeypatch.setattr(explorer_module, "in_kernel", lambda: True)
    assert explorer._background()  # a comm message: no cell is running
    explorer.worker.cell_started()
    try:
        assert not explorer._background()  # a cell's `.value =`: its next line reads it
    finally:
        explorer.worker.cell_finished()


def test_a_cell_that_starts_waits_for_the_answer_in_progress_and_says_why(capsys):
    worker = Worker()
    release, order = threading.Event(), []
    latest = LatestAnswer(worker, lambda key, values, start, future: order.append(
        ("delivered", future.result())))
    latest.ask("k", {}, 0.0, lambda: release.wait(10) and "answer")
    threading.Timer(0.2, release.set).start()
    worker.cell_started()  # the cell's runs must not overlap the worker's
    order.append("cell")
    worker.cell_finished()
    assert order == [("delivered", "answer"), "cell"]
    assert "waits for an explorer's answer in progress" in capsys.readouterr().out
    worker.cell_started()  # nothing in progress: no wait, nothing said
    worker.cell_finished()
    assert capsys.readouterr().out == ""


def test_back_to_a_setting_whose_run_was_just_stopped_measures_it_again():
    explorer = Measured()
    explorer.gates[1].set()
    explorer.controls["n"].value = 1
    while not hasattr(explorer, "run_started"):
        time.sleep(0.005)
    assert explorer.run_started.wait(10)
    explorer.controls["n"].value = 2  # in the cache: shown at once, the run stopped
    explorer.release.set()
    explorer.controls["n"].value = 1  # asked again while the stopped run unwinds
    _settle(explorer)
    # the stopped run's LaunchCancelled is no answer: n = 1 is measured once more
    assert explorer.error is None and explorer.status.value == "n=1 wide=False"
    assert explorer.runs == 2


def test_a_failure_while_showing_on_the_worker_is_said_not_left_at_measuring():
    explorer = Gated()
    explorer.gates[3].set()

    def broken_show(*args):
        raise RuntimeError("the picture could not be shown")

    explorer._show = broken_show
    explorer.controls["n"].value = 3
    _settle(explorer)
    assert explorer.error == "RuntimeError: the picture could not be shown"
    assert "could not be drawn" in explorer.status.value


def test_an_interrupt_while_asking_leaves_the_explorer_answering(monkeypatch):
    explorer = Gated()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(explorer.worker, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        explorer.controls["n"].value = 3
    monkeypatch.undo()
    assert not explorer._later.pending
    explorer.gates[1].set()
    explorer.controls["n"].value = 1  # not ignored: nothing is left "in flight"
    _settle(explorer)
    assert explorer.status.value == "n=1 wide=False"


def test_a_setting_kept_on_disk_is_shown_at_once_not_announced_as_measuring(
        tmp_path, monkeypatch):
    from minipar.viz import store

    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "cache"))  # the store on

    class StoredRuns(GatedRuns):
        def stores_results(self) -> bool:  # the test's code stands in for minipar's
            return True

    class Stored(Gated):
        RUNS = StoredRuns

    first = Stored()
    first.gates[3].set()
    first.background = False
    first.controls["n"].value = 3  # answered, and kept on disk
    later = Stored()  # a new kernel: its own RunCache, the same disk
    later.controls["n"].value = 3
    assert later.status.value == "n=3 wide=False"  # a file read: no "measuring" flash
    assert later.drawn == [] and later.measurements.store.hits == 2  # both from the disk


# ------------------------------------------------------------------ in a real kernel
KERNEL_CELL = '''
import time
from minipar.viz.controls import make_control
from minipar.viz.explorer import Explorer
from minipar.viz.lattice import Measurements
from minipar.viz.stages import stages_picture

drawn = []

class SlowRuns(Measurements):
    name = "slow (tests)"
    def measure(self, values):
        drawn.append(values["n"])
        if values["n"] == 1:
            time.sleep(1.0)
        return values

class Slow(Explorer):
    """n bars; n = 1 takes a second to measure, and cannot be stopped (no run to cancel)."""
    def __init__(self):
        self.drawn = drawn
        self.measurements = SlowRuns(None)
        super().__init__({"n": make_control("dropdown", "n", [1, 2, 3], 2)})
    def answer(self, values, result):
        n = result["n"]
        return [stages_picture([1] * n, [n] * n, 1)], f"n={n}"

explorer = Slow()
print(explorer.controls["n"].model_id, explorer.status.model_id)
'''


def test_in_a_kernel_the_next_change_from_the_browser_is_read_while_one_is_measured():
    """The real path: a kernel (jupyter_client), an explorer made by a cell, two changes
    sent as a browser sends them (comm messages), 0.1 s apart. The second is read while
    the first is drawn (1 s), supersedes it, and is the only one shown."""
    jupyter_client = pytest.importorskip("jupyter_client")
    manager, client = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        def run(code: str) -> str:
            reply_id = client.execute(code)
            out = []
            while True:
                message = client.get_iopub_msg(timeout=60)
                if message["parent_header"].get("msg_id") != reply_id:
                    continue
                if message["msg_type"] == "stream":
                    out.append(message["content"]["text"])
                if message["msg_type"] == "error":
                    raise AssertionError("\n".join(message["content"]["traceback"]))
                if (message["msg_type"] == "status"
                        and message["content"]["execution_state"] == "idle"):
                    return "".join(out)

        control_id, status_id = run(KERNEL_CELL).split()
        statuses = []

        def change(index: int) -> None:  # ipywidgets' protocol: the browser's update
            message = client.session.msg("comm_msg", {"comm_id": control_id, "data": {
                "method": "update", "state": {"index": index}, "buffer_paths": []}})
            client.shell_channel.send(message)

        change(0)  # n = 1: a second to draw
        time.sleep(0.1)
        change(2)  # n = 3, while n = 1 is drawn
        deadline = time.monotonic() + 30
        while not statuses[-1:] == ["n=3"] and time.monotonic() < deadline:
            try:
                message = client.get_iopub_msg(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
                continue
            data = message["content"].get("data", {})
            if (message["msg_type"] == "comm_msg" and message["content"]["comm_id"] == status_id
                    and "value" in data.get("state", {})):
                statuses.append(data["state"]["value"])
        assert statuses[-1:] == ["n=3"], statuses
        assert any("measuring" in s for s in statuses[:-1])
        assert "n=1" not in statuses  # drawn (it could not be stopped), never shown
        assert run("print(explorer.drawn, explorer.draws)").split("]")[0] == "[2, 1, 3"
        assert run("print(explorer.draws)").strip() == "2"  # the first picture and n = 3
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
