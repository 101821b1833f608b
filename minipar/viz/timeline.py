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

Built on `matplotlib.figure.Figure`, never pyplot, so it works without a display and a
notebook shows each figure once.
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
from minipar.viz.ticks import TICK_COPYING

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
    """(kind, start, end, label) of TimelineEvent objects or report-style dicts."""
    for event in timeline:
        if isinstance(event, dict):
            yield event["kind"], event["start"], event["end"], event.get("label", "")
        else:
            yield event.kind, event.start, event.end, event.label


def _chunk(label: str) -> int:
    """Model chunk of a pipeline label ("F3" -> 0, "B3.1" -> 1)."""
    _, dot, chunk = label.partition(".")
    return int(chunk) if dot and chunk.isdigit() else 0


def _lighter(color: str, amount: float) -> tuple:
    return tuple(c + (1.0 - c) * amount for c in to_rgb(color))


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
    where the compute row has no comm bar. Returns a matplotlib.figure.Figure.
    """
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

    fig = Figure(figsize=(width, 1.4 + 0.45 * n), layout="constrained")
    ax = fig.subplots(subplot_kw=TICK_COPYING)  # the same ticks, made faster
    min_text_width = (t1 - t0) / 40  # label a bar only if it is wider than this
    weights_drawn = False
    drawn = _Bars()
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
                ax.text((s + e - 2 * t0) / 2 / scale, y, label, ha="center", va="center",
                        fontsize=7, color=text_color, clip_on=True)
        for color, spans in bars.items():
            drawn.add(spans, (y - 0.4, 0.8), color, edgecolor="white", linewidth=0.3)
        if transfers is not None:  # the comm stream: a thin lane at the bottom of the row
            lane = [((max(t["start"], t0) - t0) / scale,
                     (min(t["end"], t1) - max(t["start"], t0)) / scale)
                    for t in transfers[y] if min(t["end"], t1) > max(t["start"], t0)]
            drawn.add(lane, (y + 0.22, 0.18), COMM_STREAM)
    drawn.draw(ax)
    ax.set_yticks(range(n), rank_labels)
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, (t1 - t0) / scale)
    ax.set_xlabel(f"simulated time ({unit})")
    if title is None:
        bubble = bubble_fraction(timelines, t0, t1)
        title = f"timeline of {n} rank{'s' * (n != 1)}: idle {bubble:.1%} of rank-time"
    # y=1.0: where matplotlib puts a title with no ticks above the axes; said, it spares
    # measuring every tick label on each draw to find that out.
    ax.set_title(title, y=1.0)
    present = {kind for row in rows for kind, *_ in row}
    handles, labels = _legend_entries(max_chunk, present)
    if weights_drawn:
        handles.insert(2, Patch(facecolor=WEIGHT_COLOR))
        labels.insert(2, "backward weight (W)")
    if transfers is not None:
        handles.append(Patch(facecolor=COMM_STREAM))
        labels.append("transfer (comm stream)")
    fig.legend(handles, labels, loc="outside lower center", ncol=len(handles),
               frameon=False, fontsize=8,
               handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})
    return fig


class _Bars:
    """Every bar of the chart in one PolyCollection, in the order they are added: what
    one `Axes.broken_barh` per row and colour draws (the same rectangles, colours and
    edges, painted in the same order), without a collection per call (~1 ms each, two to
    five per row)."""

    def __init__(self):
        self.vertices, self.faces, self.edges, self.widths = [], [], [], []

    def add(self, xranges, yrange, facecolor, edgecolor="none", linewidth=None):
        """Rectangles (x, width) spanning yrange = (y, height), as broken_barh takes them."""
        y0, height = yrange
        y1 = y0 + height
        for x0, width in xranges:
            x1 = x0 + width
            self.vertices.append([(x0, y0), (x0, y1), (x1, y1), (x1, y0)])
            self.faces.append(facecolor)
            self.edges.append(edgecolor)
            self.widths.append(mpl.rcParams["patch.linewidth"] if linewidth is None
                               else linewidth)

    def draw(self, ax) -> None:
        if self.vertices:
            ax.add_collection(PolyCollection(np.array(self.vertices), facecolors=self.faces,
                                             edgecolors=self.edges, linewidths=self.widths))


def _legend_entries(max_chunk: int, present=()) -> tuple[list, list[str]]:
    """(handles, labels), one per kind (the optimizer, comm and offload kinds only if
    `present` has them: a pipeline step alone has no optimizer, free links no comm);
    with model chunks (interleaved) forward and backward show one swatch per chunk side
    by side, in the shades the bars use."""
    handles, labels = [], []
    for kind, color in COLORS.items():
        if kind in OPTIONAL_KINDS and kind not in present:
            continue
        if max_chunk and kind in ("forward", "backward"):
            handles.append(tuple(Patch(facecolor=_lighter(color, 0.5 * c / max_chunk))
                                 for c in range(max_chunk + 1)))
            labels.append(f"{kind}, chunk {' / '.join(map(str, range(max_chunk + 1)))}")
        else:
            handles.append(Patch(facecolor=color))
            labels.append(kind)
    return handles, labels
