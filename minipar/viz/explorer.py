"""The common frame of the explorers (minipar.viz.widgets): controls, a status line and
pictures, redrawn when a control changes, each setting's pictures cached in a RunCache.

    class MyExplorer(Explorer):
        def __init__(self, cache=None):
            super().__init__({"dp": make_control("dropdown", "dp", [1, 2, 4], 2)}, cache)

        def draw(self, dp):              # -> (figures, status html)
            return [plot_memory(train_report(TrainConfig(dp=dp)))], f"dp={dp}"

A picture is drawn once by Agg with margins fixed in inches (`fixed_margins` and
`figure_png`, minipar/viz/agg.py) and shown as PNG in an `ipywidgets.Image`: a
constrained layout would measure every label again on every redraw. A refusal (a layout
the rules do not run) is shown in the status line, never raised; the last pictures, of
another setting, are hidden meanwhile.

With `prefetch` (the default inside a Jupyter kernel), the settings one control change
away are measured and drawn by a background worker while the reader looks at the
picture (minipar/viz/prefetch.py), nearest options first, so a change usually finds its
picture ready; the pictures are the ones a direct draw gives (same code, same cache).
A change made in the browser is answered on that worker (minipar/viz/background.py):
"measuring ..." at once, and a later change supersedes it, so a reader who sets dp, tp
and pp in a row waits for the last setting alone. A cell's own changes (`.value =`,
`set()`) are answered before its next line runs.

minipar's own explorers also keep every answer on disk (minipar/viz/store.py, under
~/.cache/minipar; MINIPAR_CACHE_DIR=off turns it off): a setting answered once on this
machine, shown or prepared, is answered from there by any later kernel, in milliseconds,
until minipar, its libraries or matplotlib's style change.
"""

from __future__ import annotations

import html
import time

from matplotlib.figure import Figure

from minipar.errors import ConfigError, PipelineError
from minipar.viz.agg import EXPLORER_DPI, FIGURE_WIDTH, figure_png, fixed_margins
from minipar.viz.background import LatestAnswer
from minipar.viz.controls import assign, in_control_words, the_change, widgets
from minipar.viz.nearby import ahead, neighbours
from minipar.viz.prefetch import Worker, in_kernel, shared_worker
from minipar.viz.runs import RunCache
from minipar.viz.store import AnswerStore, answer_store, style_digest

__all__ = ["EXPLORER_DPI", "FIGURE_WIDTH", "REFUSALS", "Explorer", "figure_png",
           "fixed_margins"]

# Errors that mean "this layout cannot run": shown in the status line, never raised.
REFUSALS = (ConfigError, PipelineError, NotImplementedError, ValueError)


class Explorer(widgets.VBox):
    """Controls, a status line and pictures; redraws when any control changes.

    Subclasses give `controls` (name -> widget) and `draw(**values) -> (figures, status
    html)`. `figures` are the last drawn matplotlib Figures, `draws` counts redraws,
    `error` is the last refusal (None after a successful draw), `last_seconds` the time
    the last redraw took (run + drawing + PNG). `prefetch`: prepare the neighbouring
    settings in the background (None: when running in a Jupyter kernel); `worker` is the
    process's shared worker then, else None. `background`: answer a change on the worker
    (None, the default: a change from the browser in a kernel; `_background`). `store`:
    the answers kept on disk (minipar/viz/store.py), or None (off, or an explorer whose
    drawing code is not minipar's: `stores_answers`)."""

    dpi = EXPLORER_DPI
    # A slider's prefetched neighbours: value +- 1 .. +- SLIDER_REACH (None: its whole
    # range; a slider without continuous updates moves in one change as far as dragged).
    SLIDER_REACH: int | None = None
    # Prepared pictures kept that were never shown, beyond the current neighbours: each is
    # its PNGs (50-250 KB) and its run, and a reader who moves on leaves ~10-25 of them
    # behind at every change.
    KEEP_UNSHOWN = 32
    # A drop-down's: the options up to OPTION_REACH places either side (a long list such
    # as the sharding explorer's ~50 tensors would keep the worker busy for seconds).
    OPTION_REACH = 3

    def __init__(self, controls: dict, cache: RunCache | None = None,
                 prefetch: bool | None = None, initial: dict | None = None):
        assign(type(self).__name__, controls, initial or {})  # the first setting shown
        self.controls = controls
        self.cache = RunCache() if cache is None else cache
        self.worker: Worker | None = (shared_worker() if (in_kernel() if prefetch is None
                                                          else prefetch) else None)
        self._refused: set = set()  # picture keys a prefetch found refused
        # picture key -> cache keys its prefetch added, for pictures prepared, not shown
        self._unshown: dict = {}  # yet, oldest first (what `_forget_unshown` may discard)
        self._shown_values: dict | None = None  # the setting answered last
        # Answer a change in the background (`_background`; None: a change from the
        # browser, in a kernel)? Not the first picture: it is the cell's output.
        self.background: bool | None = False
        self._later = LatestAnswer(self.worker, self._deliver)
        self.store: AnswerStore | None = answer_store() if self.stores_answers() else None
        self.status = widgets.HTML()
        self.images: list = []
        self._figures: list[Figure] | None = []  # None: drawn when asked for (`figures`)
        self._figures_only = False  # `figures` is drawing: cached_figure draws afresh
        self._style = style_digest()  # matplotlib's rcParams, part of every picture's key
        self.draws = 0
        self.error: str | None = None
        self.last_seconds = 0.0
        self._pictures = widgets.VBox()
        box = widgets.HBox(list(controls.values()),
                           layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([box, self.status, self._pictures])
        for control in controls.values():
            control.observe(self._changed, names="value")
        self.refresh()
        self.background = None

    @property
    def figures(self) -> list[Figure]:
        """The matplotlib Figures of the setting shown. The caches keep only PNGs
        (`_answer`), so the figures of an answer found ready are drawn again when asked
        for, as the PNGs were drawn."""
        with self._later.lock:
            figures, values = self._figures, self._shown_values
        if figures is None:
            figures = (self._figures_of(values) if self.worker is None
                       else self.worker.run_now(lambda: self._figures_of(values)))
            with self._later.lock:
                if self._shown_values is values and self._figures is None:
                    self._figures = figures
        return figures

    def _figures_of(self, values: dict) -> list[Figure]:
        """`draw`'s figures, none taken from `cached_figure` and none rendered."""
        self._figures_only = True
        try:
            drawn, _ = self.draw(**values)
        finally:
            self._figures_only = False
        return [item[0] if isinstance(item, tuple) else item for item in drawn]

    @property
    def figure(self) -> Figure | None:
        return self.figures[0] if self.figures else None

    def stores_answers(self) -> bool:
        """Keep answers on disk? Only for explorers drawn by minipar's own code, which
        the store's fingerprint covers; a subclass defined elsewhere draws with code
        the fingerprint cannot see."""
        return type(self).__module__.startswith("minipar.")

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def set(self, **values) -> None:
        """Change several controls, redrawing once (each `.value = ` redraws)."""
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

    def picture_key(self, values: dict) -> tuple:
        """The RunCache key of the picture of one setting, in the matplotlib style of the
        last refresh (a notebook that restyles matplotlib gets pictures in its style)."""
        return ("picture", type(self).__name__, repr(getattr(self, "config", None)),
                self._style, *sorted(values.items()))

    def refresh(self) -> None:
        start = time.perf_counter()
        self._style = style_digest()
        values = self.values()
        key = self.picture_key(values)

        def picture():
            drawn = []  # the figures, if drawn now (the cache keeps only their PNGs)
            _, pngs, message = self.cache.get(key, lambda: self._answer(key, values, drawn))
            return (drawn[0] if drawn else None), pngs, message

        try:
            if key not in self.cache:
                self.check(values)  # what the rules refuse, said at once, with no run
            # On disk: a file to read, answered here (saying "measuring" would flicker).
            ready = key in self.cache or (self.store is not None
                                          and key in self.store.stored([key]))
            if self.worker is not None and not ready and self._background():
                with self._later.lock:
                    self._say_measuring(values)
                    self._later.ask(key, values, start, picture)
                return
            self._later.supersede()  # this answer is shown, none in progress
            if self.worker is None or key in self.cache:
                answer = picture()
            else:  # on the worker thread, which does every run and drawing
                answer = self.worker.run_now(
                    picture, key, on_wait=lambda: self._say_measuring(values))
            with self._later.lock:
                self._show(key, values, answer, start)
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
                self._show(key, values, future.result(), start)
            elif isinstance(error, REFUSALS):
                self._show_refusal(values, error, start)
            else:
                self._show_failure(error)
        except Exception as failure:  # noqa: BLE001 - never 'measuring ...' forever
            self._show_failure(failure)

    def _background(self) -> bool:
        """Answer this change in the background? `background` if set, else when no cell
        is running: a change from the browser (the kernel then stays free for the next
        one), never a cell's own `.value =` or `set()`, whose next line reads the answer."""
        if self.background is not None:
            return self.background
        return in_kernel() and not self.worker.cell_running

    def _say_measuring(self, values: dict) -> None:
        """The status line while an answer is computed (in the background: at once)."""
        shown = self._pictures.layout.visibility != "hidden"  # (hidden after a refusal)
        self.status.value = (f"<span style='color:#666'>{self.pending_status(values)}"
                             + (" (the pictures below are still of the last setting)"
                                if shown else "") + "</span>")

    # ------------------------------------------------------------------ answers shown
    def _show(self, key, values: dict, answer, start: float) -> None:
        figures, pngs, message = answer
        self.error = None
        self._figures = figures
        while len(self.images) < len(pngs):
            self.images.append(widgets.Image(format="png"))
        for image, png in zip(self.images, pngs, strict=False):
            image.value = png
        self._pictures.children = tuple(self.images[:len(pngs)])
        self._pictures.layout.visibility = "visible"
        self.status.value = message
        self.draws += 1
        self.last_seconds = time.perf_counter() - start
        self._unshown.pop(key, None)  # shown: kept like every picture shown
        self._prefetch_neighbours(values)
        self._shown_values = values

    def _show_refusal(self, values: dict, refusal: Exception, start: float) -> None:
        self.error = str(refusal)
        asked = the_change(self.controls, self._shown_values, values)
        said = getattr(refusal, "said_as", "cannot run this layout")  # (NothingToShow)
        self.status.value = (f"<span style='color:#b00020'>{said}{html.escape(asked)}: "
                             f"{html.escape(self.in_control_words(self.error))}</span>")
        # The last pictures belong to another setting: hidden (their space kept, so
        # the page does not jump), never shown under controls they do not match.
        self._pictures.layout.visibility = "hidden"
        self.last_seconds = time.perf_counter() - start
        self._prefetch_neighbours(values)
        self._shown_values = values

    def _show_failure(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"
        what = ("interrupted; change a control to try again"
                if isinstance(error, KeyboardInterrupt)
                else f"this setting could not be drawn: {self.error}")
        self.status.value = f"<span style='color:#b00020'>{html.escape(what)}</span>"
        self._pictures.layout.visibility = "hidden"  # (another setting's pictures)

    def check(self, values: dict) -> None:
        """Raise one of REFUSALS for a setting the rules refuse, in a few milliseconds and
        before any run (so a refusal never waits for the worker, nor says "measuring").
        Default: nothing; `draw` refuses what this lets through."""

    def pending_status(self, values: dict) -> str:
        """The status line while a setting's answer is computed (with a worker)."""
        return "measuring and drawing this setting ..."

    def in_control_words(self, message: str) -> str:
        """A refusal in the words of these controls (`controls.in_control_words`)."""
        return in_control_words(self.controls, self.FLAG_ALIASES, message)

    # Flags of the rules that name one of this explorer's controls by another name.
    FLAG_ALIASES: dict[str, str] = {}

    # ------------------------------------------------------------------ prefetching
    def neighbours(self, values: dict) -> list[dict]:
        """The settings one control change away, nearest options first (`nearby.py`)."""
        return neighbours(self.controls, values, self.OPTION_REACH, self.SLIDER_REACH)

    def ahead(self, previous: dict | None, values: dict) -> dict | None:
        """One more step along the last change of one control, or None (`nearby.py`)."""
        return ahead(self.controls, previous, values)

    def prefetch_cost(self, values: dict) -> float | None:
        """A neighbouring setting's relative cost to prepare unasked, or None to leave it
        out. Neighbours are prepared cheapest first (ties: nearest first; but the one
        `ahead` of a sweep goes before all, however costly), so that a short
        look finds most of them ready and the worst wait of a change that comes while a
        neighbour is being prepared is short. Default: all cost the same."""
        return 1.0

    def _prefetch_neighbours(self, values: dict) -> None:
        if self.worker is None:
            return
        wanted = []
        ahead = self.ahead(self._shown_values, values)
        near = self.neighbours(values)
        on_disk = (set() if self.store is None
                   else self.store.stored([self.picture_key(s) for s in near]))
        for order, setting in enumerate(near):
            key = self.picture_key(setting)
            try:
                cost = self.prefetch_cost(setting)
            except REFUSALS:  # a setting the rules refuse: cheap to find out and show
                cost = 0.0
            if cost is not None and key in on_disk:
                cost = 0.0  # answered before, on disk: a file to read
            if key not in self.cache and key not in self._refused and cost is not None:
                wanted.append((setting != ahead, cost, order, key, setting))
        wanted.sort(key=lambda item: item[:3])  # the sweep's next step, then cheapest first
        self.worker.prefetch(self, [(key, lambda k=key, s=setting, style=self._style:
                                     self._prefetch(k, s, style))
                                    for *_, key, setting in wanted])
        self._forget_unshown({self.picture_key(s) for s in near})

    def _prefetch(self, key, values: dict, style: str) -> None:
        if style != style_digest():  # matplotlib was restyled since it was asked for
            return
        try:
            with self.cache.recording() as made:
                self.cache.get(key, lambda: self._answer(key, values, []))
            self._unshown[key] = made
        except REFUSALS:
            self._refused.add(key)

    def _forget_unshown(self, near: set) -> None:
        """Discard the oldest prepared-but-never-shown pictures (and what their prefetch
        added to the cache) past KEEP_UNSHOWN, except the current neighbours'."""
        old = [key for key in list(self._unshown) if key not in near]
        for key in old[:max(0, len(old) - self.KEEP_UNSHOWN)]:
            self.cache.discard(self._unshown.pop(key, ()))

    def _answer(self, key, values: dict, drawn: list):
        """(None, PNGs, status html) of one setting, what the RunCache keeps: from the
        disk store when it has it, else drawn (the figures appended to `drawn`) and
        stored. Never the Figures themselves: a cached Figure is ~5,000 objects that
        every full garbage collection walks (the explorers' caches held 220k of a
        kernel's 350k after bench_widgets, and a full collection then took 0.1-0.6 s in
        the middle of an answer); `figures` draws them again when asked for."""
        if self.store is not None:
            stored = self.store.load(key)
            if stored is not None:
                return None, *stored
        figures, pngs, message = self._picture(values)
        if all(fig is not None for fig in figures):
            drawn.append(figures)
        if self.store is not None:
            self.store.save(key, pngs, message)
        return None, pngs, message

    def _picture(self, values: dict):
        """(figures, their PNGs, status html) of one setting, drawn and rendered (the
        cache keeps the PNGs and the status: `_answer`). `draw` may return a figure as a
        (Figure, png) pair from `cached_figure`, whose Figure is None when its PNG was
        cached already."""
        drawn, message = self.draw(**values)
        pairs = [item if isinstance(item, tuple) else (item, figure_png(item, self.dpi))
                 for item in drawn]
        return [fig for fig, _ in pairs], [png for _, png in pairs], message

    def cached_figure(self, key, make) -> tuple[Figure | None, bytes | None]:
        """(figure, PNG) of `make()`, the PNG cached under `key`: for a picture that
        several settings share (e.g. the same run seen in another view). The figure is
        None when the PNG came from the cache (it is not kept: `_answer`), and the PNG
        None when `figures` is drawing."""
        if self._figures_only:
            return make(), None
        made = []

        def render():
            made.append(make())
            return None, figure_png(made[0], self.dpi)

        _, png = self.cache.get(("figure", type(self).__name__, self._style, key), render)
        return (made[0] if made else None), png

    def draw(self, **values):  # pragma: no cover - abstract
        raise NotImplementedError
