"""The explorers' pictures as PNG: drawn once by Agg, without measuring a label twice.

    png = figure_png(fig)              # bytes; the same pixels as fig.savefig(..., dpi=110)
    fixed_margins(fig, left=0.8, right=0.2, bottom=0.6, top=0.4)   # inches, no layout engine

An explorer answers a control change with one to three figures, and most of the time
Agg spends on them is text: matplotlib 3.11 measures every label when it lays it out
(`FT2Font.set_text`, and the font's line height from its OS/2 table), shapes it again
to draw it (`FT2Font._layout`) and has FreeType render each glyph (`_render_glyph`).
Its own cache of measurements is kept per renderer, and every draw makes a new
renderer, so each picture measured all its labels afresh, although the pictures of one
explorer share most of them (rank names, tick labels, titles, the same glyphs at the
same sub-pixel offsets). `TextCachingRenderer` keeps these results for the whole
process, keyed by everything they depend on (string, font properties, dpi, hinting;
for a glyph bitmap its size, transform and the fraction of a pixel it starts at): the
same numbers and the same arrays reach Agg, so the same pixels
(benchmarks/picture_identity.py compares the explorers' pictures with main's,
tests/viz/test_agg.py with a plain FigureCanvasAgg).

The glyph layout, line height and bitmap caches hook into how matplotlib 3.11 draws text
(its `_layout`, `_get_font_height_metrics` and `_render_glyph`); with an older matplotlib
(`GLYPH_HOOKS` false) the fonts are left as they are and only the cache of measurements
(a public renderer method) is kept: the same pixels, drawn more slowly (tests/viz/
test_agg.py runs every comparison both ways).
"""

from __future__ import annotations

import io
import threading

import matplotlib as mpl
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import fontManager, get_font
from matplotlib.ft2font import FT2Font

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
# matplotlib 3.11 lays text out in Python (`FT2Font._layout`) and hands Agg each glyph's
# bitmap (`_render_glyph`): what the layout and bitmap caches hook into. An older one
# (3.10 is the last for Python 3.10) passes the font itself to Agg's C++ `draw_text_image`,
# which takes nothing but a real FT2Font: there the fonts are not wrapped.
GLYPH_HOOKS = hasattr(FT2Font, "_layout") and hasattr(FT2Font, "_render_glyph")


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
            layout = self._font._layout(text, *args, **kwargs)
            fonts = {id(item.ft_object): _CachedGlyphFont(item.ft_object) for item in layout}
            items = self._layouts[key] = [_CachedItem(item, fonts[id(item.ft_object)])
                                          for item in layout]
        return items


class _CachedItem:
    """A glyph of a laid-out string (ft2font.LayoutItem), drawn with a _CachedGlyphFont."""

    __slots__ = ("ft_object", "glyph_index", "x", "y", "char", "prev_kern")

    def __init__(self, item, font):
        self.ft_object, self.glyph_index, self.x, self.y = font, item.glyph_index, item.x, item.y
        self.char, self.prev_kern = getattr(item, "char", None), getattr(item, "prev_kern", 0)


class _Bitmap:
    __slots__ = ("buffer", "left", "top")

    def __init__(self, buffer, left, top):
        self.buffer, self.left, self.top = buffer, left, top


class _CachedGlyphFont:
    """A FreeType font whose rendered glyph bitmaps are kept. FreeType places a glyph at
    a position in 1/64 pixel (`_set_transform`'s delta); moved by whole pixels, its
    bitmap is the same array moved by as many pixels (tests/viz/test_agg.py), so a
    bitmap is kept by glyph, size, transform matrix and the position's fraction of a
    pixel, with its offset from the position."""

    _glyphs: dict = {}

    def __init__(self, font):
        self._font = font
        # what else shapes a bitmap: the font file and face, FreeType's hinting factor
        self._face = (font.fname, getattr(font, "face_index", 0),
                      mpl.rcParams["text.hinting_factor"])
        self._size = self._matrix = self._delta = None

    def __getattr__(self, name):
        return getattr(self._font, name)

    def set_size(self, size, dpi):
        self._size = (size, dpi)

    def _set_transform(self, matrix, delta):
        self._matrix, self._delta = matrix, delta

    def _render_glyph(self, glyph_index, flags, mode):
        (dx, fx), (dy, fy) = divmod(self._delta[0], 64), divmod(self._delta[1], 64)
        key = (self._face, self._size, np.asarray(self._matrix).tobytes(), fx, fy,
               glyph_index, flags, mode)
        kept = self._glyphs.get(key)
        if kept is None:
            if len(self._glyphs) >= 4 * TEXT_CACHE_SIZE:
                self._glyphs.clear()
            self._font.set_size(*self._size)
            self._font._set_transform(self._matrix, self._delta)
            bitmap = self._font._render_glyph(glyph_index, flags, mode)
            empty = bitmap.buffer.size == 0  # FreeType places an empty bitmap at 0, 0
            kept = self._glyphs[key] = (bitmap.buffer.copy(), empty,
                                        bitmap.left - (0 if empty else dx),
                                        bitmap.top - (0 if empty else dy))
        buffer, empty, left, top = kept
        return _Bitmap(buffer.copy(), left + (0 if empty else dx), top + (0 if empty else dy))


class TextCachingRenderer(RendererAgg):
    """Agg, with each label's size (`get_text_width_height_descent`), each font's line
    height, each string's glyph layout and each glyph's bitmap kept for the process
    rather than for one draw (see the module docstring). Draws as RendererAgg draws:
    only what is computed before the drawing calls is taken from the caches."""

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
        font = super()._prepare_font(font_prop)
        if not GLYPH_HOOKS:  # (see GLYPH_HOOKS)
            return font
        return _CachedLayoutFont(font, _font_key(font_prop, self.dpi), self._layouts)


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
    margins (`fixed_margins`). zlib level 1 instead of 6: a tenth
    more bytes for the browser, a few milliseconds less per picture."""
    buffer = io.BytesIO()
    fig.set_dpi(dpi)
    TextCachingCanvas(fig).print_png(buffer, pil_kwargs={"compress_level": 1})
    # A fresh canvas holds no pixels: the drawn one keeps its RGBA buffer (~1.2 MB for
    # an 880 x 340 picture) for as long as the figure lives (an explorer keeps the
    # figures of the setting it shows). A later draw makes a new buffer.
    FigureCanvasAgg(fig)
    return buffer.getvalue()


def fixed_margins(fig: Figure, *, left: float, right: float, bottom: float,
                  top: float, row_gap: float | None = None) -> Figure:
    """Replace the figure's constrained layout by margins in inches chosen for its labels
    (row_gap: inches between rows of axes, for a figure of several).

    Constrained layout measures every label on every draw to fit the margins: about a
    quarter of an explorer's redraw. The explorers' figures have a known shape, so fixed
    margins (what constrained layout finds for them, give or take) do the same job."""
    width, height = fig.get_size_inches()
    fig.set_layout_engine("none")
    # What fig.subplots_adjust does; it refuses a figure created with a constrained layout.
    fig.subplotpars.update(left=left / width, right=1 - right / width,
                           bottom=bottom / height, top=1 - top / height)
    rows = max((ax.get_subplotspec().get_gridspec().nrows for ax in fig.axes
                if ax.get_subplotspec() is not None), default=1)
    if row_gap is not None and rows > 1:  # hspace: the gap as a fraction of a row's height
        row = (height - top - bottom - row_gap * (rows - 1)) / rows
        if row <= 0:
            raise ValueError(f"fixed_margins: a {height:g} in figure has no room for {rows} "
                             f"rows with {row_gap:g} in between them")
        fig.subplotpars.update(hspace=row_gap / row)  # (a gridspec's own hspace wins)
    for ax in fig.axes:
        if ax.get_subplotspec() is not None:  # colorbars and legends stay where they are
            ax.set_position(ax.get_subplotspec().get_position(fig))
    return fig
