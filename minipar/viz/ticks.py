"""Axes whose new ticks are copies of their first tick: the same ticks, made faster; and
how many rank labels an axis has room for.

    fig.add_axes(rect, axes_class=TickCopyingAxes)
    fig.subplots(1, 2, subplot_kw=TICK_COPYING)      # {"axes_class": TickCopyingAxes}
    every = label_every(n_ranks, most=16)            # label ranks 0, every, 2 * every ...

An axis makes a Tick for every location it labels, and the explorers' figures label
many (a traffic heatmap: every rank on both axes of every panel). matplotlib 3.11 makes
each new tick by building one from the axis's tick style (two Line2D markers, a grid
line, two Texts) and then copying the first tick's properties onto it
(`Axis._copy_tick_props`, whose `Line2D.update_from` deep-copies the marker): 0.5-0.8 ms
a tick, a third of building the traffic explorer's figures. Here a new tick is instead
a copy of the first tick, artist by artist (`copy_tick`, ~0.03 ms): the properties that
matplotlib copies are the same, and so is everything else, since the first tick was
built from the same style.
What the copies must not share (callback registries, font properties, data arrays,
path effects, sticky edges) each gets its own; the rest (transforms, marker styles,
colours: replaced, never changed in place, by matplotlib's setters) is shared.

This hooks a private path (`Axis.get_major_ticks` making ticks with `_get_tick` and
`_copy_tick_props`) through the axes' `_init_axis`, the way a custom projection
supplies its own axes (matplotlib's custom projection example). tests/viz/test_ticks.py
draws figures with these axes and with plain ones and compares the pixels;
benchmarks/picture_identity.py compares every explorer picture with main's.
"""

from __future__ import annotations

import copy

from matplotlib import axis as maxis
from matplotlib import cbook
from matplotlib.axes import Axes


def label_every(count: int, most: int) -> int:
    """Label every k-th of `count` ranks along an axis with room for `most` labels: 1 up to
    `most` (every rank), else the least power of two that brings them under `most` (32
    ranks in room for 12: every 4th; powers of two fall on the node boundaries of the
    usual layouts). tests/viz/test_legibility.py checks that the labels stay apart."""
    every, most = 1, max(1, most)  # (an axis with room for none still gets one)
    while count > most * every:
        every *= 2
    return every


def _copy_artist(artist):
    """A copy of an artist that shares nothing it could change in place."""
    new = copy.copy(artist)  # Artist.__getstate__: no stale callback (as a new artist)
    new._callbacks = cbook.CallbackRegistry(signals=["pchanged"])
    new._path_effects = list(artist._path_effects)
    if artist._sticky_edges is not None:
        new._sticky_edges = type(artist._sticky_edges)(list(artist._sticky_edges.x),
                                                       list(artist._sticky_edges.y))
    if hasattr(artist, "_fontproperties"):  # a Text: set_fontsize changes it in place
        new._fontproperties = artist._fontproperties.copy()
    if hasattr(artist, "_xorig"):  # a Line2D: its own data, recomputed at the next draw
        new._xorig, new._yorig = copy.copy(artist._xorig), copy.copy(artist._yorig)
        new._invalidx = new._invalidy = True
        new._transformed_path = None
    return new


def copy_tick(tick):
    """A new tick like `tick` (what `Axis.get_major_ticks` makes from the first tick)."""
    new = _copy_artist(tick)
    for name in ("tick1line", "tick2line", "gridline", "label1", "label2"):
        setattr(new, name, _copy_artist(getattr(tick, name)))
    return new


class _TickCopying:
    """An Axis whose new major and minor ticks are copies of its first one."""

    def get_major_ticks(self, numticks=None):
        if numticks is None:
            numticks = len(self.get_majorticklocs())
        ticks = self.majorTicks  # the first tick, made as matplotlib makes it
        while len(ticks) < numticks:
            ticks.append(copy_tick(ticks[0]))
        return ticks[:numticks]

    def get_minor_ticks(self, numticks=None):
        if numticks is None:
            numticks = len(self.get_minorticklocs())
        ticks = self.minorTicks
        while len(ticks) < numticks:
            ticks.append(copy_tick(ticks[0]))
        return ticks[:numticks]


class TickCopyingXAxis(_TickCopying, maxis.XAxis):
    pass


class TickCopyingYAxis(_TickCopying, maxis.YAxis):
    pass


class TickCopyingAxes(Axes):
    """Axes with TickCopyingXAxis and TickCopyingYAxis (see the module docstring)."""

    def _init_axis(self):  # Axes._init_axis, with these axis classes
        self.xaxis = TickCopyingXAxis(self, clear=False)
        self.spines.bottom.register_axis(self.xaxis)
        self.spines.top.register_axis(self.xaxis)
        self.yaxis = TickCopyingYAxis(self, clear=False)
        self.spines.left.register_axis(self.yaxis)
        self.spines.right.register_axis(self.yaxis)


TICK_COPYING = {"axes_class": TickCopyingAxes}  # subplot_kw for Figure.subplots
