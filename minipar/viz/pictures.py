"""The explorers' pictures: data sent to the browser and drawn there, or drawn by
matplotlib from the same data.

    view = PictureView()                  # an anywidget: SVG drawn in the browser
    view.pictures = [memory_picture(report)]   # a few KB of JSON per change
    figure = draw_picture(memory_picture(report))  # the same data, a matplotlib Figure

Why: a picture is data (bars per rank and category, a rank x rank matrix, a timeline of
intervals). Rendered as PNG in the kernel, each control change cost ~0.1-0.25 s of
matplotlib; sent as data, a change costs the kernel a few milliseconds and the browser a
redraw of a few hundred SVG shapes (minipar/viz/pictures.js, ~400 lines of plain
JavaScript, no library: anywidget loads it from this package, so JupyterLab 4 needs
nothing but `pip install minipar[notebooks]`). The static figures of the notebooks, the
docs and the CLI stay matplotlib's, drawn from the same data by the `draw_*` functions
(`draw_picture` picks one by the picture's "figure"): the browser and matplotlib are
given the same numbers (tests/viz/test_pictures.py compares them).
"""

from __future__ import annotations

import json
import pathlib

from matplotlib.figure import Figure

from minipar.viz.margins import FIGURE_WIDTH
from minipar.viz.memory import draw_memory
from minipar.viz.sharding import draw_sharding
from minipar.viz.stages import draw_stages
from minipar.viz.timeline import draw_timeline
from minipar.viz.traffic import draw_sent_bytes, draw_traffic

try:
    import anywidget
    import traitlets
except ImportError as error:  # the library itself does not need anywidget
    raise ImportError("minipar's explorers need anywidget: pip install 'minipar[notebooks]' "
                      "(or pip install anywidget)") from error

# The matplotlib drawer of each picture, by the picture's "figure".
DRAWERS = {"memory": draw_memory, "sent_bytes": draw_sent_bytes, "traffic": draw_traffic,
           "timeline": draw_timeline, "sharding": draw_sharding, "stages": draw_stages}


def draw_picture(picture: dict) -> Figure:
    """The matplotlib Figure of an explorer's picture, at the width a notebook shows."""
    drawer = DRAWERS[picture["figure"]]
    if picture["figure"] == "traffic":  # its width is in the picture (the panels' geometry)
        return drawer(picture)
    return drawer(picture, width=FIGURE_WIDTH)


class PictureView(anywidget.AnyWidget):
    """The pictures of one explorer setting, drawn as SVG in the browser.

    pictures: the pictures' data (`memory_picture`, `traffic_picture` ...), sent as JSON
    text (`data`: ipywidgets walks a list of dicts for binary buffers, element by
    element, ~10 ms for a sharding picture; a string it sends as it is); setting: what
    they show (the explorer's setting, as text); visible: False hides them (their space
    kept, so the page does not jump), as after a refusal."""

    _esm = pathlib.Path(__file__).with_name("pictures.js")
    data = traitlets.Unicode("[]").tag(sync=True)
    setting = traitlets.Unicode("").tag(sync=True)
    visible = traitlets.Bool(True).tag(sync=True)
    # The explorer's controls ([model id, label]) and status line (model id): when the
    # reader changes a control, the browser says so in the status line at once, before
    # the kernel has heard of it (the kernel's answer replaces it).
    controls = traitlets.List([]).tag(sync=True)
    status_id = traitlets.Unicode("").tag(sync=True)

    @property
    def pictures(self) -> list[dict]:
        return json.loads(self.data)

    @pictures.setter
    def pictures(self, pictures: list[dict]) -> None:
        self.data = json.dumps(pictures, separators=(",", ":"), allow_nan=False)
