"""The explorers' pictures as PNG: drawn once by Agg, without measuring a label twice.

    png = figure_png(fig)              # bytes; the same pixels as fig.savefig(..., dpi=110)

An explorer answers a control change with one to three figures, and most of the time
Agg spends on them is text: matplotlib 3.11 measures every label when it lays it out,
then shapes its glyphs again to draw it (`FT2Font.set_text`, `FT2Font._layout`). Its own
cache of measurements is kept per renderer, and every draw makes a new renderer, so each
picture measured all its labels afresh, although the pictures of one explorer share most
of them (rank names, tick labels, titles). `TextCachingRenderer` keeps both results for
the whole process, keyed by everything they depend on (string, font properties, dpi,
hinting): the same measurements and the same glyphs at the same positions, so the same
pixels (benchmarks/picture_identity.py compares them with a plain Agg draw).
"""

from __future__ import annotations

import io
import threading

import matplotlib as mpl
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import fontManager, get_font

# JupyterLab stretches an ipywidgets.Image to the output area's width (829 px at a
# 1280 px window, measured in Chromium), whatever the PNG's pixels. So the size a
# reader sees is set by the figure's width in inches: 8 in -> ~104 display px per inch,
# 7 pt text ~10 px (tests/viz/test_legibility.py). The dpi only decides sharpness:
# 110 dpi gives 880 px, at least what the output area shows.
FIGURE_WIDTH = 8.0
EXPLORER_DPI = 110
# Entries each cache keeps (one per distinct label string and font): the explorers use a
# few hundred; past this the cache starts again rather than grow without bound.
TEXT_CACHE_SIZE = 4096


def _font_key(prop, dpi: float) -> tuple:
    """What picks and sizes the font of `prop`: its properties (a copy, as matplotlib's
    own cache keys them: FontProperties hash by their mutable state), the dpi, the
    rcParams that change the glyphs' shapes or spacing, and the thread (FreeType fonts
    are one per thread, `matplotlib.font_manager.get_font`)."""
    rc = mpl.rcParams
    return (prop.copy(), dpi, rc["text.hinting"], rc["text.hinting_factor"],
            rc["text.kerning_factor"], rc.get("font.enable_last_resort"),
            threading.get_ident())


class _CachedLayoutFont:
    """A FreeType font whose glyph layout of a string (`_layout`: glyph indices and
    positions, the same for every draw of that string in this font) is kept; every
    other call goes to the font."""

    def __init__(self, font, key: tuple, layouts: dict):
        self._font, self._key, self._layouts = font, key, layouts

    def __getattr__(self, name):
        return getattr(self._font, name)

    def _layout(self, text, *args, **kwargs):
        key = (self._key, text, repr(args), repr(sorted(kwargs.items())))
        items = self._layouts.get(key)
        if items is None:
            if len(self._layouts) >= TEXT_CACHE_SIZE:
                self._layouts.clear()
            items = self._layouts[key] = self._font._layout(text, *args, **kwargs)
        return items


class TextCachingRenderer(RendererAgg):
    """Agg, with each label's size (`get_text_width_height_descent`) and glyph layout
    kept for the process rather than for one draw (see the module docstring)."""

    _metrics: dict = {}
    _layouts: dict = {}
    _line_heights: dict = {}

    def get_text_width_height_descent(self, s, prop, ismath):
        if ismath:  # mathtext and TeX: parsed by their own machinery, not kept
            return super().get_text_width_height_descent(s, prop, ismath)
        key = (_font_key(prop, self.dpi), s)
        metrics = self._metrics.get(key)
        if metrics is None:
            if len(self._metrics) >= TEXT_CACHE_SIZE:
                self._metrics.clear()
            metrics = self._metrics[key] = super().get_text_width_height_descent(
                s, prop, ismath)
        return metrics

    def _get_font_height_metrics(self, prop):
        """(ascent, descent, line gap) of the font, in pixels: what matplotlib 3.11's
        `Text._get_layout` asks a renderer that has this method, and otherwise reads from
        the font's OS/2 or hhea table for every text it lays out. The same reading, in
        the same order of operations (so the same floats), once per font and size."""
        key = _font_key(prop, self.dpi)
        heights = self._line_heights.get(key)
        if heights is None:
            if len(self._line_heights) >= TEXT_CACHE_SIZE:
                self._line_heights.clear()
            heights = self._line_heights[key] = self._read_font_heights(prop)
        return heights

    def _read_font_heights(self, prop):
        font = get_font(fontManager._find_fonts_by_props(prop))
        for table_name, line_gap_key, ascent_key, descent_key in (
                ("OS/2", "sTypoLineGap", "sTypoAscender", "sTypoDescender"),
                ("hhea", "lineGap", "ascent", "descent")):
            table = font.get_sfnt_table(table_name)
            if table is None:
                continue
            units_per_em = font.get_sfnt_table("head")["unitsPerEm"]
            scale = 1 / units_per_em * prop.get_size_in_points() * self.dpi / 72
            return (table[ascent_key] * scale, -table[descent_key] * scale,
                    table[line_gap_key] * scale)
        return None, None, None  # matplotlib measures "lp" instead

    def _prepare_font(self, font_prop):
        return _CachedLayoutFont(super()._prepare_font(font_prop),
                                 _font_key(font_prop, self.dpi), self._layouts)


class TextCachingCanvas(FigureCanvasAgg):
    """FigureCanvasAgg drawing with a TextCachingRenderer."""

    def get_renderer(self):
        width, height = self.get_width_height(physical=True)
        key = width, height, self.figure.dpi
        if self._lastKey != key:
            self.renderer = TextCachingRenderer(width, height, self.figure.dpi)
            self._lastKey = key
        return self.renderer


def figure_png(fig: Figure, dpi: int = EXPLORER_DPI) -> bytes:
    """The figure as PNG bytes, drawn once by Agg (needs no display).

    Not `fig.savefig`: for a figure that has (or had) a layout engine it draws the figure
    twice, once to lay it out and once to render, and the explorers' figures have fixed
    margins (minipar.viz.explorer.fixed_margins). zlib level 1 instead of 6: a tenth
    more bytes for the browser, a few milliseconds less per picture."""
    buffer = io.BytesIO()
    fig.set_dpi(dpi)
    TextCachingCanvas(fig).print_png(buffer, pil_kwargs={"compress_level": 1})
    # A fresh canvas holds no pixels: the drawn one keeps its RGBA buffer (~1.2 MB for
    # an 880 x 340 picture) for as long as the cached figure lives, and the explorers
    # cache every picture they show or prefetch. A later draw makes a new buffer.
    FigureCanvasAgg(fig)
    return buffer.getvalue()
