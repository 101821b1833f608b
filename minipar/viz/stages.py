"""A pipeline's stages side by side: the forwards each holds at its peak (from the
schedule) and the activation bytes it held (measured).

    picture = stages_picture(in_flight=[4, 3, 2, 1], activations=[...], virtual_stages=1)
    fig = draw_stages(picture)

The pipeline explorer's second picture (minipar/viz/widgets.py), drawn in the browser
from the same data (minipar/viz/pictures.js).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from minipar.viz.margins import FIGURE_WIDTH, fixed_margins
from minipar.viz.tables import byte_unit

COLOR = "#8e6bb8"


def stages_picture(in_flight: list[int], activations: list[int], virtual_stages: int) -> dict:
    """Two panels of one bar per rank (JSON). With v chunks a rank holds v stages
    (interleaved: r, r+p, ...; V: r and 2p-1-r), so its bars are a rank's."""
    pp = len(in_flight)
    word, short = ("stage", "S") if virtual_stages == 1 else ("rank", "r")
    # 8 "stage 7" labels run into each other in half the width
    ticks = [[r, f"{word} {r}" if pp <= 4 else f"{short}{r}"] for r in range(pp)]
    unit, scale = byte_unit(max(activations))
    forwards = ("micro-batch x chunk forwards" if virtual_stages > 1 else "forwards")
    return {"kind": "bars", "figure": "stages", "layout": "row", "legend": [], "panels": [
        {"title": f"{forwards} awaiting their backward\n(peak, from the schedule)",
         "ylabel": "", "xlabel": None, "unit": "", "scale": 1, "ticks": ticks,
         "series": [{"name": "in flight", "color": COLOR, "values": list(in_flight)}]},
        {"title": f"peak activations held\n({unit}, measured)", "ylabel": "",
         "xlabel": None, "unit": unit, "scale": scale, "ticks": ticks,
         "series": [{"name": "activations", "color": COLOR, "values": list(activations)}]},
    ]}


def draw_stages(picture: dict, width: float = FIGURE_WIDTH) -> Figure:
    """The matplotlib figure of a `stages_picture`: its two panels side by side."""
    fig = Figure(figsize=(width, 2.4))
    axes = fig.subplots(1, 2)
    fixed_margins(fig, left=0.45, right=0.2, bottom=0.35, top=0.5)
    for ax, panel in zip(axes, picture["panels"], strict=True):
        (series,) = panel["series"]
        ranks = [x for x, _ in panel["ticks"]]
        ax.bar(ranks, np.array(series["values"]) / panel["scale"], color=series["color"])
        ax.set_title(panel["title"], fontsize=8, y=1.0)
        ax.set_xticks(ranks, [label for _, label in panel["ticks"]], fontsize=7)
    return fig
