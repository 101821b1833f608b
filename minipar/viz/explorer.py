"""The common frame of the explorers (minipar.viz.widgets): controls, a status line and
pictures, redrawn when a control changes, each setting's pictures cached in a RunCache.

    class MyExplorer(Explorer):
        def __init__(self, cache=None):
            super().__init__({"dp": _control("dropdown", "dp", [1, 2, 4], 2)}, cache)

        def draw(self, dp):              # -> (figures, status html)
            return [plot_memory(train_report(TrainConfig(dp=dp)))], f"dp={dp}"

A picture is drawn once by Agg with margins fixed in inches (`figure_png`,
`fixed_margins`) and shown as PNG in an `ipywidgets.Image`: a constrained layout would
measure every label again on every redraw. A refusal (a layout the rules do not run) is
shown in the status line, never raised.
"""

from __future__ import annotations

import html
import io
import time

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from minipar.parallel.schedules import PipelineError
from minipar.train.config import ConfigError
from minipar.viz.runs import RunCache

try:
    import ipywidgets as widgets
except ImportError as error:  # the library itself does not need ipywidgets
    raise ImportError("minipar.viz.widgets needs ipywidgets: pip install 'minipar[notebooks]' "
                      "(or pip install 'ipywidgets>=8')") from error

# Errors that mean "this layout cannot run": shown in the status line, never raised.
REFUSALS = (ConfigError, PipelineError, NotImplementedError, ValueError)
# JupyterLab stretches an ipywidgets.Image to the output area's width (829 px at a
# 1280 px window, measured in Chromium), whatever the PNG's pixels. So the size a
# reader sees is set by the figure's width in inches: 8 in -> ~104 display px per inch,
# 7 pt text ~10 px (tests/viz/test_legibility.py). The dpi only decides sharpness:
# 110 dpi gives 880 px, at least what the output area shows.
FIGURE_WIDTH = 8.0
EXPLORER_DPI = 110


def figure_png(fig: Figure, dpi: int = EXPLORER_DPI) -> bytes:
    """The figure as PNG bytes, drawn once by Agg (needs no display).

    Not `fig.savefig`: for a figure that has (or had) a layout engine it draws the figure
    twice, once to lay it out and once to render, and the explorers' figures have fixed
    margins (`fixed_margins`). zlib level 1 instead of 6: a tenth more bytes for the
    browser, a few milliseconds less per picture."""
    buffer = io.BytesIO()
    fig.set_dpi(dpi)
    FigureCanvasAgg(fig).print_png(buffer, pil_kwargs={"compress_level": 1})
    return buffer.getvalue()


def fixed_margins(fig: Figure, *, left: float, right: float, bottom: float,
                  top: float) -> Figure:
    """Replace the figure's constrained layout by margins in inches chosen for its labels.

    Constrained layout measures every label on every draw to fit the margins: about a
    quarter of an explorer's redraw. The explorers' figures have a known shape, so fixed
    margins (what constrained layout finds for them, give or take) do the same job."""
    width, height = fig.get_size_inches()
    fig.set_layout_engine("none")
    # What fig.subplots_adjust does; it refuses a figure created with a constrained layout.
    fig.subplotpars.update(left=left / width, right=1 - right / width,
                           bottom=bottom / height, top=1 - top / height)
    for ax in fig.axes:
        if ax.get_subplotspec() is not None:  # colorbars and legends stay where they are
            ax.set_position(ax.get_subplotspec().get_position(fig))
    return fig


# ------------------------------------------------------------------ the common frame
def _control(kind, description: str, options=None, value=None, width="170px"):
    style = {"description_width": "initial"}
    layout = widgets.Layout(width=width)
    if kind == "dropdown":
        return widgets.Dropdown(options=options, value=value, description=description,
                                style=style, layout=layout)
    if kind == "check":
        return widgets.Checkbox(value=value, description=description, style=style,
                                layout=layout, indent=False)
    if kind == "slider":
        low, high = options
        return widgets.IntSlider(value=value, min=low, max=high, description=description,
                                 style=style, layout=widgets.Layout(width=width),
                                 continuous_update=False)
    raise ValueError(kind)


class Explorer(widgets.VBox):
    """Controls, a status line and pictures; redraws when any control changes.

    Subclasses give `controls` (name -> widget) and `draw(**values) -> (figures, status
    html)`. `figures` are the last drawn matplotlib Figures, `draws` counts redraws,
    `error` is the last refusal (None after a successful draw), `last_seconds` the time
    the last redraw took (run + drawing + PNG)."""

    dpi = EXPLORER_DPI

    def __init__(self, controls: dict, cache: RunCache | None = None):
        self.controls = controls
        self.cache = RunCache() if cache is None else cache
        self.status = widgets.HTML()
        self.images: list = []
        self.figures: list[Figure] = []
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

    @property
    def figure(self) -> Figure | None:
        return self.figures[0] if self.figures else None

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def set(self, **values) -> None:
        """Change several controls, redrawing once (each `.value = ` redraws)."""
        for control in self.controls.values():
            control.unobserve(self._changed, names="value")
        try:
            for name, value in values.items():
                if name not in self.controls:
                    raise KeyError(f"{type(self).__name__} has no control {name!r}; it has "
                                   f"{', '.join(self.controls)}")
                self.controls[name].value = value
        finally:
            for control in self.controls.values():
                control.observe(self._changed, names="value")
        self.refresh()

    def _changed(self, change) -> None:
        self.refresh()

    def refresh(self) -> None:
        start = time.perf_counter()
        values = self.values()
        key = (type(self).__name__, repr(getattr(self, "config", None)),
               *sorted(values.items()))
        try:
            figures, pngs, message = self.cache.get(("picture", key),
                                                    lambda: self._picture(values))
        except REFUSALS as refusal:
            self.error = str(refusal)
            self.status.value = ("<span style='color:#b00020'>cannot run this layout: "
                                 f"{html.escape(self.error)}</span>")
            self.last_seconds = time.perf_counter() - start
            return
        self.error = None
        self.figures = figures
        while len(self.images) < len(figures):
            self.images.append(widgets.Image(format="png"))
        for image, png in zip(self.images, pngs, strict=False):
            image.value = png
        self._pictures.children = tuple(self.images[:len(figures)])
        self.status.value = message
        self.draws += 1
        self.last_seconds = time.perf_counter() - start

    def _picture(self, values: dict):
        """(figures, their PNGs, status html) of one setting: what the cache keeps, so
        returning to a setting redraws nothing. `draw` may return a figure as a
        (Figure, png) pair it took from `cached_figure`."""
        drawn, message = self.draw(**values)
        pairs = [item if isinstance(item, tuple) else (item, figure_png(item, self.dpi))
                 for item in drawn]
        return [fig for fig, _ in pairs], [png for _, png in pairs], message

    def cached_figure(self, key, make) -> tuple[Figure, bytes]:
        """(figure, PNG) of `make()`, cached under `key`: for a picture that several
        settings share (e.g. the same run seen in another view)."""
        def render():
            fig = make()
            return fig, figure_png(fig, self.dpi)

        return self.cache.get(("figure", type(self).__name__, key), render)

    def draw(self, **values):  # pragma: no cover - abstract
        raise NotImplementedError
