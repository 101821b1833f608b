"""A Gantt chart of the ranks' simulated timelines: what each virtual GPU did, and when.

    fig = plot_timeline(report.timelines)          # or plot_timeline(report)
    fig.savefig("timeline.png")

One row per rank: forward, backward, optimizer and communication bars on an idle
background, so the pipeline bubble is the grey. Compute bars carry their label when the
run set one (the pipeline labels each micro-batch: F3 = forward of micro-batch 3,
B3.1 = backward of micro-batch 3 on model chunk 1); later chunks of an interleaved schedule
are drawn lighter, as in Figure 4 of Narayanan et al. 2021, and the legend shows each
chunk's shade ("forward, chunk 0 / 1"). A zero-bubble schedule's
backward is split: I3 (its input gradient, the backward colour) and W3 (the weight
gradients, WEIGHT_COLOR, with its own legend entry), as the ZB paper draws B and W apart.

`timeline_picture` gives what the chart shows as data, `draw_timeline` draws it: an
explorer sends the same data to the browser (minipar/viz/pictures.py), so the two never
disagree. Built on `matplotlib.figure.Figure`, never pyplot, so it works without a
display and a notebook shows each figure once.
"""

from __future__ import annotations

import matplotlib as mpl
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.patches import Patch

from minipar.distributed.timeline import bubble_fraction

COLORS = {
    "forward": "#3b75af",
    "backward": "#e1812c",
    "optimizer": "#3a923a",
    "comm": "#c03d3e",
    "idle": "#e6e6e6",
    # with offload (minipar/distributed/tiers.py): CPU Adam, waiting for PCIe / NVMe
    "host_optimizer": "#8c564b",
    "transfer": "#9467bd",
}
COMM_STREAM = "#7a1f1f"  # transfers in flight, also while the rank computes
WEIGHT_COLOR = "#8c6bb1"  # W: a backward labelled "W3" (weight gradients only)
OFFLOAD_KINDS = ("host_optimizer", "transfer")
OPTIONAL_KINDS = ("optimizer", "comm", *OFFLOAD_KINDS)  # in the legend only when drawn
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def _events(timeline):
    """(kind, start, end, label) of TimelineEvent objects, report-style dicts or
    [kind, start, end, label] lists (what an explorer keeps)."""
    for event in timeline:
        if isinstance(event, dict):
            yield event["kind"], event["start"], event["end"], event.get("label", "")
        elif isinstance(event, list | tuple):
            yield tuple(event)
        else:
            yield event.kind, event.start, event.end, event.label


def _chunk(label: str) -> int:
    """Model chunk of a pipeline label ("F3" -> 0, "B3.1" -> 1)."""
    _, dot, chunk = label.partition(".")
    return int(chunk) if dot and chunk.isdigit() else 0


def _lighter(color: str, amount: float) -> tuple:
    return tuple(c + (1.0 - c) * amount for c in to_rgb(color))


def timeline_picture(timelines, *, title: str | None = None, rank_labels=None,
                     start: float | None = None, end: float | None = None,
                     show_labels: bool = True, transfers=None) -> dict:
    """What the Gantt chart shows, as data (JSON): every bar ([x, width, y, height, colour
    index, edge] in the time unit chosen, y the rank row), the labels written on bars, the
    rank labels, the axis unit and the legend. `plot_timeline` draws it with matplotlib,
    an explorer in the browser (minipar/viz/pictures.js). Arguments as plot_timeline's."""
    if hasattr(timelines, "timelines"):  # a Report
        if transfers is True:
            transfers = timelines.transfers
        timelines = timelines.timelines
    if transfers is True:
        raise ValueError("plot_timeline: transfers=True needs a Report (pass its "
                         "report.transfers otherwise)")
    if not timelines:
        raise ValueError("plot_timeline: no timelines (a report from minipar.train carries "
                         "report.timelines; JSON reports do not)")
    rows = [list(_events(t)) for t in timelines]
    t0 = min((e[1] for row in rows for e in row), default=0.0) if start is None else start
    t1 = max((e[2] for row in rows for e in row), default=t0) if end is None else end
    if t1 <= t0:
        raise ValueError(f"plot_timeline: empty time window [{t0}, {t1}]")
    unit, scale = next(((u, s) for u, s in TIME_UNITS if (t1 - t0) >= 2 * s), TIME_UNITS[-1])
    n = len(rows)
    if rank_labels is None:
        rank_labels = [f"rank {r}" for r in range(n)]
    if len(rank_labels) != n:
        raise ValueError(f"plot_timeline: {len(rank_labels)} rank labels for {n} ranks")
    max_chunk = max((_chunk(e[3]) for row in rows for e in row), default=0)

    min_text_width = (t1 - t0) / 40  # label a bar only if it is wider than this
    weights_drawn = False
    drawn = _Bars()
    texts = []
    for y, row in enumerate(rows):
        drawn.add([((0.0), (t1 - t0) / scale)], (y - 0.4, 0.8), COLORS["idle"])
        bars: dict[tuple, list] = {}
        spans: list[list] = []  # [label, start, end, color] of labelled compute
        for kind, s, e, label in row:
            s, e = max(s, t0), min(e, t1)
            if e <= s or kind == "idle":
                continue
            color = COLORS.get(kind, "#999999")
            if kind == "backward" and label.startswith("W"):
                color, weights_drawn = WEIGHT_COLOR, True
            if max_chunk and kind in ("forward", "backward"):
                color = _lighter(color, 0.5 * _chunk(label) / max_chunk)
            bars.setdefault(color, []).append(((s - t0) / scale, (e - s) / scale))
            if label and kind != "comm":
                # One label per micro-batch's compute, even when a tensor-parallel
                # all-reduce cuts it into slivers: extend the span while the label holds.
                if spans and spans[-1][0] == label:
                    spans[-1][2] = e
                else:
                    spans.append([label, s, e, color])
        for label, s, e, color in spans if show_labels else ():
            if e - s >= min_text_width:
                r, g, b = to_rgb(color)
                text_color = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"
                texts.append([(s + e - 2 * t0) / 2 / scale, y, label, text_color])
        for color, spans in bars.items():
            drawn.add(spans, (y - 0.4, 0.8), color, edge=True)
        if transfers is not None:  # the comm stream: a thin lane at the bottom of the row
            lane = [((max(t["start"], t0) - t0) / scale,
                     (min(t["end"], t1) - max(t["start"], t0)) / scale)
                    for t in transfers[y] if min(t["end"], t1) > max(t["start"], t0)]
            drawn.add(lane, (y + 0.22, 0.18), COMM_STREAM)
    if title is None:
        bubble = bubble_fraction([[{"kind": k, "start": s, "end": e} for k, s, e, _ in row]
                                  for row in rows], t0, t1)
        title = f"timeline of {n} rank{'s' * (n != 1)}: idle {bubble:.1%} of rank-time"
    present = {kind for row in rows for kind, *_ in row}
    legend = _legend_entries(max_chunk, present)
    if weights_drawn:
        legend.insert(2, {"label": "backward weight (W)",
                          "colors": [list(to_rgb(WEIGHT_COLOR))]})
    if transfers is not None:
        legend.append({"label": "transfer (comm stream)",
                       "colors": [list(to_rgb(COMM_STREAM))]})
    return {"kind": "timeline", "figure": "timeline", "title": title,
            "xlabel": f"simulated time ({unit})",
            "xmax": (t1 - t0) / scale, "rank_labels": list(rank_labels),
            "colors": drawn.palette, "bars": drawn.bars, "texts": texts, "legend": legend}


def plot_timeline(timelines, *, title: str | None = None, rank_labels=None,
                  start: float | None = None, end: float | None = None,
                  show_labels: bool = True, width: float = 10.0,
                  transfers=None) -> Figure:
    """A Gantt chart of per-rank timelines (one list of events per rank, or a Report).

    title: default names the ranks and the bubble fraction (idle / total over ranks);
    rank_labels: one y-axis label per rank (default "rank r"); start, end: the time window
    in seconds (default the whole run); show_labels: write micro-batch labels on bars
    wide enough to hold them; transfers: per rank, the transfers as the communication
    stream ran them ({"start", "end"} dicts, `report.transfers`; True with a Report),
    drawn as a thin lane under each row, so a transfer hidden behind compute shows
    where the compute row has no comm bar. Returns a matplotlib.figure.Figure:
    `timeline_picture` drawn by `draw_timeline`.
    """
    return draw_timeline(timeline_picture(timelines, title=title, rank_labels=rank_labels,
                                          start=start, end=end, show_labels=show_labels,
                                          transfers=transfers), width)


def draw_timeline(picture: dict, width: float = 10.0) -> Figure:
    """The matplotlib figure of a `timeline_picture`."""
    n = len(picture["rank_labels"])
    fig = Figure(figsize=(width, 1.4 + 0.45 * n), layout="constrained")
    ax = fig.subplots()
    palette = picture["colors"]
    if picture["bars"]:
        # every bar in one PolyCollection, in the order they were added: what one
        # `Axes.broken_barh` per row and colour draws, without a collection per call
        bars = np.array(picture["bars"], dtype=float)
        x, w, y, h = bars[:, :4].T
        edge = bars[:, 5] > 0
        vertices = np.stack([np.stack([x, y], 1), np.stack([x, y + h], 1),
                             np.stack([x + w, y + h], 1), np.stack([x + w, y], 1)], 1)
        faces = [palette[int(c)] for c in bars[:, 4]]
        linewidth = mpl.rcParams["patch.linewidth"]
        ax.add_collection(PolyCollection(vertices, facecolors=faces,
                                         edgecolors=["white" if e else "none" for e in edge],
                                         linewidths=[0.3 if e else linewidth for e in edge]))
    for x, y, label, text_color in picture["texts"]:
        ax.text(x, y, label, ha="center", va="center", fontsize=7, color=text_color,
                clip_on=True)
    ax.set_yticks(range(n), picture["rank_labels"])
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, picture["xmax"])
    ax.set_xlabel(picture["xlabel"])
    # y=1.0: where matplotlib puts a title with no ticks above the axes
    ax.set_title(picture["title"], y=1.0)
    handles = [tuple(Patch(facecolor=c) for c in entry["colors"])
               if len(entry["colors"]) > 1 else Patch(facecolor=entry["colors"][0])
               for entry in picture["legend"]]
    fig.legend(handles, [entry["label"] for entry in picture["legend"]],
               loc="outside lower center", ncol=len(handles), frameon=False, fontsize=8,
               handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})
    return fig


class _Bars:
    """The chart's bars in the order they are added (the order they are painted): [x,
    width, y, height, colour index, edge] each, the colours once in `palette` ([r, g, b]
    from 0 to 1: a lighter shade of a chunk is no whole 8-bit value)."""

    def __init__(self):
        self.bars, self.palette, self._index = [], [], {}

    def add(self, xranges, yrange, facecolor, edge: bool = False):
        """Rectangles (x, width) spanning yrange = (y, height), as broken_barh takes them;
        edge: a thin white edge (compute bars, apart from their neighbours)."""
        y0, height = yrange
        color = tuple(to_rgb(facecolor))
        if color not in self._index:
            self._index[color] = len(self.palette)
            self.palette.append(list(color))
        for x0, width in xranges:
            self.bars.append([x0, width, y0, height, self._index[color], int(edge)])


def _legend_entries(max_chunk: int, present=()) -> list[dict]:
    """{"label", "colors"}, one per kind (the optimizer, comm and offload kinds only if
    `present` has them: a pipeline step alone has no optimizer, free links no comm);
    with model chunks (interleaved) forward and backward show one swatch per chunk side
    by side, in the shades the bars use."""
    entries = []
    for kind, color in COLORS.items():
        if kind in OPTIONAL_KINDS and kind not in present:
            continue
        if max_chunk and kind in ("forward", "backward"):
            entries.append({"label": f"{kind}, chunk "
                                     f"{' / '.join(map(str, range(max_chunk + 1)))}",
                            "colors": [list(_lighter(color, 0.5 * c / max_chunk))
                                       for c in range(max_chunk + 1)]})
        else:
            entries.append({"label": kind, "colors": [list(to_rgb(color))]})
    return entries
