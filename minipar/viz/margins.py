"""Figures laid out with margins in inches, for labels of a known size.

    fixed_margins(fig, left=0.8, right=0.2, bottom=0.6, top=0.4)   # inches, no layout engine

A constrained layout measures every label again on every draw to fit the margins; the
figures whose labels are known in advance (the explorers' static figures, the bytes each
rank sent) say their margins instead, what a constrained layout finds give or take.
"""

from __future__ import annotations

from matplotlib.figure import Figure

# JupyterLab stretches a picture to the output area's width (829 px at a 1280 px window,
# measured in Chromium): an 8 in figure shows 7 pt text at ~10 display px
# (tests/viz/test_legibility.py).
FIGURE_WIDTH = 8.0


def fixed_margins(fig: Figure, *, left: float, right: float, bottom: float,
                  top: float, row_gap: float | None = None) -> Figure:
    """Replace the figure's constrained layout by margins in inches chosen for its labels
    (row_gap: inches between rows of axes, for a figure of several)."""
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
