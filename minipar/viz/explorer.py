"""The common frame of the explorers (minipar.viz.widgets): controls, a status line and
pictures drawn in the browser, answered from measurements made beforehand.

    class MyExplorer(Explorer):
        def __init__(self, cache=None):
            self.measurements = TrainRuns(MY_CONFIG, cache)
            super().__init__({"dp": make_control("dropdown", "dp", [1, 2, 4], 2)}, cache)

        def answer(self, values, result):   # -> (pictures, status html)
            report = summary_report(result, MY_CONFIG.replace(**values))
            return [memory_picture(report)], f"dp={values['dp']}"

A change of a control is answered in three steps. The rules first (`check`: a refused
layout is said in red at once, with no run). Then the result of the setting: a setting
of the explorer's lattice was measured beforehand (shipped with the package, or measured
in the background: minipar/viz/lattice.py), one measured before on this machine is on
disk; either is found in a millisecond or two, and the pictures' data (a few KB of JSON,
`answer`) go to the browser, which draws them (minipar/viz/pictures.py). Otherwise the
setting is measured now, on the explorer's worker (minipar/viz/prefetch.py): the status
line says at once what is measured, and counts the milliseconds ("measuring one training
step on 64 virtual ranks ... 300 ms so far"), over the last setting's pictures, until the
result comes; a later change supersedes it (minipar/viz/background.py). A cell's own
changes (`.value =`, `set()`) are answered before its next line runs.

With `prefetch` (the default inside a Jupyter kernel), an explorer whose lattice is not
shipped (another model than the default) measures it on the worker in spare time, the
settings nearest the one shown first, saying how far it got (`progress`). Tests drive
the explorers headless: set a control's `.value` and the callback runs synchronously;
`explorer.pictures` holds the data sent to the browser, `explorer.figures` the same
drawn by matplotlib, `explorer.status.value` what was said, `explorer.error` a refusal.
"""

from __future__ import annotations

import html
import threading
import time

from matplotlib.figure import Figure

from minipar.errors import ConfigError, PipelineError
from minipar.viz.background import LatestAnswer
from minipar.viz.controls import assign, distance, in_control_words, the_change, widgets
from minipar.viz.lattice import Measurements, key_text
from minipar.viz.pictures import PictureView, draw_picture
from minipar.viz.prefetch import Worker, in_kernel, shared_worker
from minipar.viz.runs import RunCache

__all__ = ["REFUSALS", "Explorer"]

# Errors that mean "this layout cannot run": shown in the status line, never raised.
REFUSALS = (ConfigError, PipelineError, NotImplementedError, ValueError)
# How often the status line of a setting being measured counts the time so far.
TICK_S = 0.25


class Explorer(widgets.VBox):
    """Controls, a status line and pictures; answers when any control changes.

    Subclasses set `measurements` (what they measure: minipar/viz/lattice.py) and give
    `controls` (name -> widget), `answer(values, result) -> (pictures, status html)` and
    `lattice()`. `pictures` is the data of the setting shown, `figures` the same drawn
    by matplotlib, `draws` counts answers shown, `error` is the last refusal (None after
    an answer), `last_seconds` the time the last answer took. `prefetch`: measure the
    lattice in the background when it is not shipped (None: when running in a Jupyter
    kernel); `worker` is the process's shared worker then, else None. `background`:
    answer a change to measure on the worker (None, the default: a change from the
    browser in a kernel; `_background`)."""

    measurements: Measurements

    def __init__(self, controls: dict, cache: RunCache | None = None,
                 prefetch: bool | None = None, initial: dict | None = None):
        assign(type(self).__name__, controls, initial or {})  # the first setting shown
        self.controls = controls
        self.cache = self.measurements.cache
        self.worker: Worker | None = (shared_worker() if (in_kernel() if prefetch is None
                                                          else prefetch) else None)
        self._shown_values: dict | None = None  # the setting answered last
        # Answer a change in the background (`_background`; None: a change from the
        # browser, in a kernel)? Not the first picture: it is the cell's output.
        self.background: bool | None = False
        self._later = LatestAnswer(self.worker, self._deliver)
        self._ticking: threading.Event | None = None  # set: stop counting "... ms so far"
        self._lattice: list[dict] | None = None  # the lattice, once planned (`_plan`)
        self._refused: set = set()  # keys of lattice settings the rules refused
        self._verdicts: dict = {}  # setting -> what `check` said (None: it runs)
        self.status = widgets.HTML()
        self.progress = widgets.HTML()  # how far the background lattice pass got
        self.view = PictureView()
        self.pictures: list[dict] = []
        self.draws = 0
        self.error: str | None = None
        self.last_seconds = 0.0
        box = widgets.HBox(list(controls.values()),
                           layout=widgets.Layout(flex_flow="row wrap"))
        self.view.controls = [[c.model_id, c.description] for c in controls.values()]
        self.view.status_id = self.status.model_id
        super().__init__([box, self.status, self.view, self.progress])
        for control in controls.values():
            control.observe(self._changed, names="value")
        self.refresh()
        self.background = None

    @property
    def figures(self) -> list[Figure]:
        """The pictures of the setting shown, drawn by matplotlib from the same data."""
        return [draw_picture(picture) for picture in self.pictures]

    @property
    def figure(self) -> Figure | None:
        return self.figures[0] if self.pictures else None

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def set(self, **values) -> None:
        """Change several controls, answering once (each `.value = ` answers)."""
        for control in self.controls.values():
            control.unobserve(self._changed, names="value")
        try:
            assign(type(self).__name__, self.controls, values)
        finally:
            for control in self.controls.values():
                control.observe(self._changed, names="value")
        self.refresh()

    def _changed(self, change) -> None:  # (a control's observer: `set` unhooks it)
        self.refresh()

    # ------------------------------------------------------------------ the subclass's
    def measured(self, values: dict) -> dict:
        """The settings the measurement of `values` depends on (the rest are views of it).
        Default: all of them."""
        return values

    def check(self, values: dict) -> None:
        """Raise one of REFUSALS for a setting the rules refuse, in a few milliseconds and
        before any run (so a refusal never waits for the worker, nor says "measuring").
        Default: nothing; `answer` refuses what this lets through."""

    def _check(self, values: dict) -> None:
        """`check`, its verdict kept per setting (the rules are a pure function of it)."""
        key = key_text(values)
        if key not in self._verdicts:
            try:
                self.check(values)
                self._verdicts[key] = None
            except REFUSALS as refusal:
                self._verdicts[key] = refusal
        if self._verdicts[key] is not None:
            raise self._verdicts[key]

    def answer(self, values: dict, result: dict) -> tuple[list[dict], str]:
        """(the pictures' data, status html) of a setting from its measured result."""
        raise NotImplementedError  # pragma: no cover - abstract

    def lattice(self) -> list[dict]:
        """The measured settings (`measured`'s) of every setting this explorer offers that
        is measured beforehand. Default: none."""
        return []

    def pending_status(self, values: dict) -> str:
        """The status line while a setting is measured."""
        return "measuring this setting ..."

    def in_control_words(self, message: str) -> str:
        """A refusal in the words of these controls (`controls.in_control_words`)."""
        return in_control_words(self.controls, self.FLAG_ALIASES, message)

    # Flags of the rules that name one of this explorer's controls by another name.
    FLAG_ALIASES: dict[str, str] = {}

    # ------------------------------------------------------------------ answering
    def refresh(self) -> None:
        start = time.perf_counter()
        values = self.values()
        try:
            self._check(values)  # what the rules refuse, said at once, with no run
            measured = self.measured(values)
            result = self.measurements.known(measured)
            if result is not None:  # measured beforehand: answered here and now
                self._later.supersede()
                answer = self.answer(values, result)
                with self._later.lock:
                    self._show(values, answer, start)
                return
            key = self.measurements.key(measured)

            def compute():
                return self.answer(values, self.measurements.get(measured, looked=True))

            if self.worker is not None and self._background():
                with self._later.lock:
                    self._say_measuring(values, start)
                    self._later.ask(key, values, start, compute)
                return
            self._later.supersede()  # this answer is shown, none in progress
            if self.worker is None:
                answer = compute()
            else:  # on the worker thread, which does every run
                answer = self.worker.run_now(
                    compute, key, on_wait=lambda: self._say_measuring(values, start))
            with self._later.lock:
                self._show(values, answer, start)
        except REFUSALS as refusal:
            self._later.supersede()
            with self._later.lock:
                self._show_refusal(values, refusal, start)
            return
        except BaseException as error:  # a bug or an interrupt: never "measuring" forever
            self._later.supersede()
            with self._later.lock:
                self._show_failure(error)
            raise

    def _deliver(self, key, values: dict, start: float, future) -> None:
        """An answer computed in the background (minipar/viz/background.py), on the
        worker thread: its pictures, its refusal, or its failure in the status line
        (there is nobody to raise it to)."""
        error = future.exception()
        try:
            if error is None:
                self._show(values, future.result(), start)
            elif isinstance(error, REFUSALS):
                self._show_refusal(values, error, start)
            else:
                self._show_failure(error)
        except Exception as failure:  # noqa: BLE001 - never 'measuring ...' forever
            self._show_failure(failure)

    def _background(self) -> bool:
        """Measure this change in the background? `background` if set, else when no cell
        is running: a change from the browser (the kernel then stays free for the next
        one), never a cell's own `.value =` or `set()`, whose next line reads the answer."""
        if self.background is not None:
            return self.background
        return in_kernel() and not self.worker.cell_running

    def _say_measuring(self, values: dict, start: float) -> None:
        """The status line while a setting is measured, counting the milliseconds so far
        every TICK_S until the answer (or another change) comes."""
        self._stop_ticking()
        stop = self._ticking = threading.Event()
        shown = self.view.visible  # (hidden after a refusal)
        said = self.pending_status(values)
        after = " (the pictures below are still of the last setting)" if shown else ""

        def say():
            elapsed = 1000 * (time.perf_counter() - start)
            self._say(f"<span style='color:#666'>{said} {elapsed:.0f} ms so far{after}</span>")

        def tick():
            while not stop.wait(TICK_S):
                with self._later.lock:
                    if not stop.is_set():
                        say()

        say()
        threading.Thread(target=tick, name="minipar-explorer-status", daemon=True).start()

    def _say(self, text: str) -> None:
        """The status line; sent to the browser even when it reads as before (the browser
        wrote its own there when the reader changed a control: pictures.js)."""
        if self.status.value == text:
            self.status.send_state("value")
        self.status.value = text

    def _stop_ticking(self) -> None:
        if self._ticking is not None:
            self._ticking.set()
            self._ticking = None

    # ------------------------------------------------------------------ answers shown
    def _show(self, values: dict, answer, start: float) -> None:
        pictures, message = answer
        self._stop_ticking()
        self.error = None
        self.pictures = pictures
        self._say(message)  # (first: the smaller message)
        with self.view.hold_sync():  # one message: the browser draws once
            self.view.pictures = pictures
            self.view.setting = key_text(values)
            self.view.visible = True
        self.draws += 1
        self.last_seconds = time.perf_counter() - start
        self._shown_values = values
        self._measure_lattice(values)

    def _show_refusal(self, values: dict, refusal: Exception, start: float) -> None:
        self._stop_ticking()
        self.error = str(refusal)
        asked = the_change(self.controls, self._shown_values, values)
        said = getattr(refusal, "said_as", "cannot run this layout")  # (NothingToShow)
        self._say(f"<span style='color:#b00020'>{said}{html.escape(asked)}: "
                  f"{html.escape(self.in_control_words(self.error))}</span>")
        # The last pictures belong to another setting: hidden (their space kept, so
        # the page does not jump), never shown under controls they do not match.
        with self.view.hold_sync():
            self.view.setting = key_text(values)
            self.view.visible = False
        self.last_seconds = time.perf_counter() - start
        self._shown_values = values

    def _show_failure(self, error: BaseException) -> None:
        self._stop_ticking()
        self.error = f"{type(error).__name__}: {error}"
        what = ("interrupted; change a control to try again"
                if isinstance(error, KeyboardInterrupt)
                else f"this setting could not be drawn: {self.error}")
        self._say(f"<span style='color:#b00020'>{html.escape(what)}</span>")
        self.view.visible = False  # (another setting's pictures)

    # ------------------------------------------------------------------ the lattice
    def _measure_lattice(self, values: dict) -> None:
        """With a worker and a lattice that is not shipped: measure it in spare time, the
        settings nearest `values` first (planned on the worker the first time: listing
        a lattice checks every setting's rules, up to a second)."""
        if self.worker is None or self.measurements.shipped:
            return
        if self._lattice is None:
            self.worker.prefetch(self, [(None, lambda: self._plan(values))])
            return
        here = self.measured(values)
        missing = sorted(self._missing(), key=lambda m: distance(self.controls, here, m))
        self._say_progress(len(self._lattice) - len(missing))
        self.worker.prefetch(self, [(self.measurements.key(m), lambda m=m: self._prepare(m))
                                    for m in missing])

    def _plan(self, values: dict) -> None:
        self._lattice = self.lattice()
        with self._later.lock:
            self._measure_lattice(self._shown_values or values)

    def _prepare(self, measured: dict) -> None:
        """One setting of the lattice, measured in spare time (a refused one is skipped:
        asked for, its refusal is found by the rules)."""
        try:
            self.measurements.get(measured)
        except REFUSALS:
            self._refused.add(self.measurements.key(measured))
        done = len(self._lattice) - len(self._missing())
        with self._later.lock:
            self._say_progress(done)

    def _missing(self) -> list[dict]:
        """The settings of the lattice neither known nor found refused."""
        return [m for m in self._lattice if not self.measurements.is_known(m)
                and self.measurements.key(m) not in self._refused]

    def _say_progress(self, done: int) -> None:
        total = len(self._lattice)
        self.progress.value = ("" if done >= total else
                               f"<span style='color:#666'>measuring this explorer's "
                               f"{total:,} settings in the background, the nearest first: "
                               f"{done:,} ready (a change to one of them answers at once)"
                               "</span>")
