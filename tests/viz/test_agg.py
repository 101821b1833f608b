"""figure_png draws what plain Agg draws, pixel for pixel, however warm its text caches.

The caches (minipar/viz/agg.py) keep each label's measurements, glyph layout, line
height and glyph bitmaps for the process; a picture drawn after others that share its
labels, at other positions or another dpi, or under other hinting, must still be the one
a fresh FigureCanvasAgg draws. Each comparison runs with the glyph hooks matplotlib 3.11
offers and without them (what an older matplotlib gets: `agg.GLYPH_HOOKS`).
"""

from __future__ import annotations

import inspect
import io

import matplotlib as mpl
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.ft2font import FT2Font
from PIL import Image

from minipar.viz import agg

THIS_MATPLOTLIB_HAS_THE_HOOKS = agg.GLYPH_HOOKS  # (the fixture below changes agg's)


def _picture(shift: float, title: str) -> Figure:
    """Labels shared between pictures, placed at fractional-pixel offsets of `shift`."""
    fig = Figure(figsize=(4.0 + shift, 2.5))
    ax = fig.add_axes((0.2 + shift / 50, 0.25, 0.6, 0.55))
    ax.bar(range(4), [3, 1, 4, 1], color="#3b75af")
    ax.set_xticks(range(4), [f"rank {r}\n(0,{r},1)" for r in range(4)], fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("bytes (MiB)")
    fig.text(0.5 + shift / 37, 0.02, "r3 (dp1 pp0 tp1): 50%", ha="center", fontsize=8)
    fig.text(0.02, 0.5, "B3.1 F4", fontsize=7, antialiased=False)  # FreeType's mono mode
    return fig


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))


def _plain_png(fig: Figure, dpi: int) -> bytes:
    buffer = io.BytesIO()
    fig.set_dpi(dpi)
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


@pytest.fixture(params=[True, False], ids=["glyph hooks", "no glyph hooks"], autouse=True)
def glyph_hooks(request, monkeypatch):
    if request.param and not agg.GLYPH_HOOKS:
        pytest.skip(f"matplotlib {mpl.__version__} draws text without FT2Font._layout")
    monkeypatch.setattr(agg, "GLYPH_HOOKS", request.param)
    return request.param


def test_the_fonts_are_wrapped_only_where_agg_lays_text_out_in_python():
    # matplotlib 3.10's RendererAgg.draw_text hands the font to C++ (draw_text_image),
    # which refuses anything but a real FT2Font: a wrapped font broke every picture there.
    lays_out_in_python = "._layout(" in inspect.getsource(RendererAgg.draw_text)
    assert THIS_MATPLOTLIB_HAS_THE_HOOKS is lays_out_in_python, mpl.__version__
    font = agg.TextCachingRenderer(10, 10, 72)._prepare_font(FontProperties())
    assert (type(font) is FT2Font) is (not agg.GLYPH_HOOKS)


def test_warm_text_caches_draw_the_pixels_plain_agg_draws():
    agg.figure_png(_picture(0.0, "peak bytes per rank"))  # warms the caches
    for shift, dpi in ((0.0, 110), (0.013, 110), (0.37, 110), (0.2, 72)):
        fig = _picture(shift, "peak bytes per rank")
        expected = _pixels(_plain_png(fig, dpi))
        assert np.array_equal(_pixels(agg.figure_png(fig, dpi)), expected), (shift, dpi)


def test_hinting_is_part_of_what_the_caches_remember():
    agg.figure_png(_picture(0.0, "hinted"))
    with mpl.rc_context({"text.hinting": "no_hinting"}):
        fig = _picture(0.0, "hinted")
        unhinted = _pixels(_plain_png(fig, 110))
        assert np.array_equal(_pixels(agg.figure_png(fig)), unhinted)
    assert not np.array_equal(unhinted, _pixels(_plain_png(_picture(0.0, "hinted"), 110)))


def test_the_drawn_figure_keeps_no_caching_canvas():
    fig = _picture(0.0, "canvas")
    agg.figure_png(fig)
    assert type(fig.canvas) is FigureCanvasAgg
