"""The traffic matrix: how many bytes each rank sent to each other rank, by group.

    fig = plot_traffic(report)          # one heatmap per group kind that sent bytes
    fig.savefig("traffic.png")
    plot_sent_bytes(report, by="op")    # each rank's bytes sent, stacked by collective
    traffic_picture(report)             # what plot_traffic draws, as data (JSON)
    cross_node_bytes(traffic_of(report), gpus_per_node=4)   # bytes that leave a node

Cell [i, j] of a heatmap is the bytes rank i (row) sent to rank j (column) per optimizer
step, as the ring algorithm moves them (minipar.distributed books every collective's bytes
per peer). One panel per group kind: the TP group's all-reduces show up as blocks of
neighbouring ranks, the pipeline's sends as single off-diagonal cells, the DP group's
all-reduce (or ZeRO's reduce-scatter and all-gather) as a stripe between distant ranks.
Dashed lines mark node boundaries: the cells that cross them use the slow network.

`traffic_picture` and `sent_picture` give what the figures show as data, `draw_traffic`
and `draw_sent_bytes` draw it: an explorer sends the same data to the browser
(minipar/viz/pictures.py), so the two never disagree. Built on
`matplotlib.figure.Figure`, never pyplot.
"""

from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import LogNorm, to_hex
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from minipar.train.report import Report
from minipar.viz.margins import FIGURE_WIDTH, fixed_margins
from minipar.viz.tables import BINARY_UNITS, byte_unit, human_bytes
from minipar.viz.ticks import label_every

MAX_NODE_LINES = 8  # nodes a side up to which their boundaries are drawn
# Room a rank label needs along a matrix's side: two digits of 7 pt and a gap (inches).
LABEL_PITCH_IN = 0.15
BAR_LABELS_MOST = 16  # rank labels under the bars of bytes sent, at most ("r10 / 0/1/0")
GROUP_TITLES = {"tp": "tensor parallel (tp)", "cp": "context parallel (cp)",
                "pp": "pipeline (pp)", "dp": "data parallel / ZeRO (dp)",
                "ep": "expert parallel (ep)", "other": "other"}

GROUP_COLORS = {"dp": "#3b75af", "tp": "#c03d3e", "pp": "#e1812c", "other": "#9a9a9a"}
OP_COLORS = {"all_reduce": "#3b75af", "reduce_scatter": "#e1812c", "all_gather": "#3a923a",
             "send": "#c03d3e", "broadcast": "#8e6bb8", "reduce": "#8c564b",
             "barrier": "#9a9a9a", "recv": "#cccccc"}


def traffic_matrices(report, per_step: bool = True) -> dict[str, np.ndarray]:
    """{group kind: (world, world) bytes sent i -> j} from the report (per step by
    default), in the order tp, cp, pp, dp, ep, other, only kinds that sent something."""
    if report.traffic is None:
        raise ValueError("plot_traffic: this report has no traffic matrix (reports from "
                         "minipar.train carry one in report.traffic)")
    steps = max(1, len(report.steps)) if per_step else 1
    by_group = report.traffic.get("by_group", {})
    return {kind: np.asarray(by_group[kind], dtype=np.float64) / steps
            for kind in GROUP_TITLES if kind in by_group}


def traffic_picture(report, *, title: str | None = None, annotate: bool | None = None,
                    width: float | None = None, gpus_per_node: int | None = None) -> dict:
    """What the heatmaps show, as data (JSON): per group kind the cells that sent bytes
    ([i, j, bytes per step, colour]), the log colour scale and its ticks, the node
    boundaries and the ranks labelled along the sides. `plot_traffic` draws it with
    matplotlib, an explorer in the browser (minipar/viz/pictures.js). Arguments as
    `plot_traffic`'s."""
    matrices = traffic_matrices(report)
    world = report.world_size
    if annotate is None:
        annotate = world <= 8
    if not matrices:
        raise ValueError("plot_traffic: no rank sent any bytes (a single-device run?)")
    positive = [m[m > 0] for m in matrices.values()]
    low, high = min(p.min() for p in positive), max(p.max() for p in positive)
    # At least a factor 4 from the darkest colour to the brightest: cells within a few
    # per cent of each other (a TP group's ring) look alike, and the bar's ticks differ.
    norm = LogNorm(vmin=min(low, high / 4), vmax=high)
    geometry = _geometry(len(matrices), width)
    per_node = gpus_per_node or (report.layout or {}).get("gpus_per_node", world)
    # A panel's side (1.8-2.4 in) has room for side / LABEL_PITCH_IN rank labels: past
    # that, every k-th rank is labelled (and ticked).
    # Past MAX_NODE_LINES nodes a side the dashes form a mesh over cells ~2 px wide (128
    # ranks, 4 per node): the title says where the nodes end instead.
    nodes = -(-world // per_node)
    boundaries = range(per_node, world, per_node) if nodes <= MAX_NODE_LINES else ()
    labelled = range(0, world, label_every(world, int(geometry["side"] / LABEL_PITCH_IN)))
    cmap = colormaps["viridis"]
    panels = []
    for kind, matrix in matrices.items():
        rows, cols = np.nonzero(matrix > 0)
        sent = matrix[rows, cols]
        shade = np.asarray(norm(sent))  # (the colour map and norm once per panel)
        colors = [to_hex(rgba) for rgba in cmap(shade)]
        # [i, j, bytes, colour, the colour of its text, its text]
        cells = [[int(i), int(j), float(v), color, "black" if x > 0.6 else "white",
                  cell_bytes(v)]
                 for i, j, v, color, x in zip(rows, cols, sent, colors, shade, strict=True)]
        panels.append({"group": kind, "title": f"{GROUP_TITLES[kind]}\n"
                                                f"{human_bytes(matrix.sum())} per step in total",
                       "cells": cells})
    ticks = (np.geomspace(norm.vmin, norm.vmax, 4) if norm.vmax > norm.vmin
             else [norm.vmin])
    nodes_said = ("dashed lines = node boundaries" if nodes <= MAX_NODE_LINES else
                  f"{nodes} nodes of {per_node} ranks (boundaries not drawn)")
    return {"kind": "matrix", "figure": "traffic", "world": world, "panels": panels,
            "annotate": annotate,
            "norm": [float(norm.vmin), float(norm.vmax)],
            "colorbar": {"label": "bytes sent per step",
                         "ticks": [[float(t), human_bytes(t)] for t in ticks],
                         # the colour at 0, 1/8, ... 1 of the log scale (an SVG gradient)
                         "stops": [to_hex(cmap(k / 8)) for k in range(9)]},
            "boundaries": list(boundaries), "labelled": list(labelled),
            "geometry": geometry,
            "title": title or "traffic matrix: bytes rank i (row) sent to rank j (column); "
                              + nodes_said}


def plot_traffic(report, *, title: str | None = None, annotate: bool | None = None,
                 width: float | None = None, gpus_per_node: int | None = None) -> Figure:
    """One heatmap per group kind of the bytes rank i sent to rank j per step.
    annotate: write the bytes in the cells (default: when there are at most 8 ranks);
    width: inches (default 3.6 per panel, plus the colour bar); gpus_per_node: where to
    draw the node boundaries (default: the report's layout). `traffic_picture` drawn by
    `draw_traffic`."""
    return draw_traffic(traffic_picture(report, title=title, annotate=annotate, width=width,
                                        gpus_per_node=gpus_per_node))


def draw_traffic(picture: dict) -> Figure:
    """The matplotlib figure of a `traffic_picture`."""
    world = picture["world"]
    fig, axes, bar_axes = _layout(picture["geometry"])
    norm = LogNorm(*picture["norm"])
    labelled, image = picture["labelled"], None
    for ax, panel in zip(axes, picture["panels"], strict=True):
        matrix = np.zeros((world, world))
        for i, j, sent, *_ in panel["cells"]:
            matrix[i, j] = sent
        shown = np.ma.masked_where(matrix <= 0, matrix)
        image = ax.imshow(shown, cmap="viridis", norm=norm)
        ax.set_facecolor("#f2f2f2")
        ax.set_title(panel["title"], fontsize=8, y=1.0)
        # The ticks' style before the ticks: each new tick copies it as it is made,
        # instead of every tick being restyled after (the same ticks, fewer calls).
        ax.tick_params(labelsize=7)
        if ax is not axes[0]:  # the panels share their rows: one set of row labels says it
            ax.tick_params(labelleft=False)
        ax.set_xticks(labelled)
        ax.set_yticks(labelled)
        ax.set_xlabel("to rank", fontsize=8)
        if ax is axes[0]:
            ax.set_ylabel("from rank", fontsize=8)
        for boundary in picture["boundaries"]:
            ax.axhline(boundary - 0.5, color="black", linestyle="--", linewidth=0.8)
            ax.axvline(boundary - 0.5, color="black", linestyle="--", linewidth=0.8)
        if picture["annotate"]:
            for i, j, _, _, text_color, text in panel["cells"]:
                ax.text(j, i, text, ha="center", va="center", fontsize=6, color=text_color)
    bar = fig.colorbar(image, cax=bar_axes)
    bar.set_label(picture["colorbar"]["label"], fontsize=8)
    # A few labelled ticks spread evenly on the log scale, in KiB / MiB; no minor ticks
    # (a log axis makes dozens, unlabelled).
    bar.ax.minorticks_off()
    bar.ax.tick_params(labelsize=7)
    bar.set_ticks([value for value, _ in picture["colorbar"]["ticks"]])
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(value)))
    fig.suptitle(picture["title"], fontsize=9)
    return fig


def cell_bytes(n: float) -> str:
    """Bytes in at most three digits over their unit, to fit a matrix cell (0.23 in at 8
    ranks in three panels): 403,251 -> "394" over "KiB", 3,565,158 -> "3.4" over "MiB".
    human_bytes' "393.8 KiB" was as wide as a cell; the colour bar and the panel totals
    give the finer figure."""
    value, unit = float(n), "B"
    for unit in BINARY_UNITS:
        if abs(value) < 999.5 or unit == "TiB":  # 1000-1023 KiB: '1.0 MiB', 3 digits
            break
        value /= 1024
    digits = f"{value:.1f}" if abs(value) < 9.95 and unit != "B" else f"{value:.0f}"
    return f"{digits}\n{unit}"


# Margins in inches for the labels around the square panels (what a constrained layout
# finds, give or take, without measuring every label on every draw).
LEFT, GAP, BAR_GAP, BAR, BAR_LABELS = 0.55, 0.3, 0.2, 0.12, 1.0
# A panel's side at most, in a figure of a given width (a single panel 5.5 in square was
# taller than a screen); the panels are centred in the width.
MAX_SIDE = 3.0
TOP, BOTTOM = 0.75, 0.5


def _geometry(n: int, width: float | None) -> dict:
    """Inches of a figure of n square panels side by side and a colour bar, with fixed
    margins: its width and height, each panel's left edge, their side and the colour
    bar's left edge. Panels are 2.8 in unless `width` (inches) says how wide the whole
    figure is (default: 2.4 in panels, at most 8 in in all, so that a notebook shows 7 pt
    labels at ~10 px)."""
    margins = LEFT + GAP * (n - 1) + BAR_GAP + BAR + BAR_LABELS
    side = min(2.4, (8.0 - margins) / n) if width is None else (width - margins) / n
    if side < 0.5:
        raise ValueError(f"plot_traffic: width={width} in leaves {side:.2f} in per panel "
                         f"for {n} panels; give at least {margins + 0.5 * n:.1f} in")
    used = margins + n * side
    if width is not None and side > MAX_SIDE:  # one or two panels: centred, not blown up
        side = MAX_SIDE
    width = used if width is None else width
    left = LEFT + (width - margins - n * side) / 2
    return {"width": width, "height": TOP + side + BOTTOM, "side": side,
            "lefts": [left + k * (side + GAP) for k in range(n)],
            "bar_left": left + n * side + GAP * (n - 1) + BAR_GAP}


def _layout(geometry: dict):
    """(figure, panel axes, colour-bar axes) placed as `geometry` says."""
    width, height, side = geometry["width"], geometry["height"], geometry["side"]
    fig = Figure(figsize=(width, height))
    axes = [fig.add_axes((left / width, BOTTOM / height, side / width, side / height))
            for left in geometry["lefts"]]
    bar_axes = fig.add_axes((geometry["bar_left"] / width, BOTTOM / height, BAR / width,
                             side / height), label="<colorbar>")
    return fig, axes, bar_axes


# ------------------------------------------------------------------ per rank, the totals
def traffic_of(report: Report) -> np.ndarray:
    """The rank x rank matrix of bytes sent ([i, j]: rank i to rank j) of a run."""
    if not report.traffic or "matrix" not in report.traffic:
        raise ValueError("this report carries no traffic matrix (report.traffic); it "
                         "comes from minipar.train.train")
    return np.asarray(report.traffic["matrix"], dtype=np.int64)


def sent_picture(report: Report, *, by: str = "group") -> dict:
    """What the bars of bytes sent show, as data (JSON): per group kind (by="group": dp /
    tp / pp) or collective (by="op") each rank's bytes sent per optimizer step, from the
    report's ranks[i]["comm"], with the axis unit and the rank labels."""
    if by not in ("group", "op"):
        raise ValueError(f"plot_sent_bytes: by must be 'group' or 'op', got {by!r}")
    steps = max(1, len(report.steps))
    key, colors = ("by_group", GROUP_COLORS) if by == "group" else ("by_op", OP_COLORS)
    names = sorted({name for r in report.ranks for name, b in r["comm"][key].items() if b},
                   key=lambda name: list(colors).index(name) if name in colors else 99)
    n = len(report.ranks)
    unit, scale = byte_unit(max(max(r["comm"]["sent_bytes"] for r in report.ranks), 1)
                             / steps)
    sent = {name: np.array([r["comm"][key].get(name, 0) for r in report.ranks])
            for name in names}  # bytes per rank, over all steps
    total = sum(per_rank.sum() for per_rank in sent.values())
    # An op of a few bytes (the loss's all-reduce: 16 B beside 700 KiB) has a legend
    # entry and no visible bar: the label says why.
    series = [{"name": name, "color": colors.get(name, "#777777"),
               "label": name if per_rank.sum() >= 0.01 * total else f"{name} (<1%)",
               "values": (per_rank / steps).tolist()} for name, per_rank in sent.items()]
    every = label_every(n, BAR_LABELS_MOST)
    panel = {"title": f"each rank's bytes sent per step, by {by}",
             "ylabel": f"bytes sent per step ({unit})", "xlabel": "rank, dp/pp/tp",
             "unit": unit, "scale": scale, "series": series,
             "ticks": [[i, coords_label(r) if r["rank"] % every == 0 else ""]
                       for i, r in enumerate(report.ranks)]}
    return {"kind": "bars", "figure": "sent_bytes", "layout": "row", "panels": [panel],
            "legend": [{"label": s["label"], "color": s["color"]} for s in series]}


def plot_sent_bytes(report: Report, *, by: str = "group",
                    width: float = FIGURE_WIDTH) -> Figure:
    """Each rank's bytes sent per optimizer step, stacked by group kind (by="group":
    dp / tp / pp) or by collective (by="op"), from the report's ranks[i]["comm"]:
    `sent_picture` drawn by `draw_sent_bytes`."""
    return draw_sent_bytes(sent_picture(report, by=by), width)


def draw_sent_bytes(picture: dict, width: float = FIGURE_WIDTH) -> Figure:
    """The matplotlib figure of a `sent_picture`."""
    (panel,) = picture["panels"]
    fig = Figure(figsize=(width, 2.8))
    ax = fig.subplots()
    fixed_margins(fig, left=0.75, right=1.4, bottom=0.75, top=0.3)
    n = len(panel["ticks"])
    bottom = np.zeros(n)
    for series in panel["series"]:
        values = np.array(series["values"]) / panel["scale"]
        ax.bar(range(n), values, bottom=bottom, label=series["label"], width=0.7,
               color=series["color"])
        bottom += values
    # From 0: autoscaling stops the axis at a sticky edge near it when the lowest bars are
    # that thin (7.6e-06 MiB at dp 8, by op), and the 0 tick went missing.
    ax.set_ylim(bottom=0)
    ax.set_xticks([x for x, _ in panel["ticks"]], [label for _, label in panel["ticks"]],
                  fontsize=7)
    ax.set_xlabel(panel["xlabel"], fontsize=8)
    ax.set_ylabel(panel["ylabel"])
    ax.set_title(panel["title"], fontsize=9, y=1.0)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def cross_node_bytes(matrix: np.ndarray, gpus_per_node: int) -> int:
    """Bytes of the matrix that go from one node to another."""
    node = np.arange(matrix.shape[0]) // gpus_per_node
    return int(matrix[node[:, None] != node[None, :]].sum())


def coords_label(rank: dict) -> str:
    """A tick label of one rank: "r5" over its dp/pp/tp coordinates."""
    c = rank.get("coords", {})
    return f"r{rank['rank']}\n{c.get('dp', 0)}/{c.get('pp', 0)}/{c.get('tp', 0)}"
