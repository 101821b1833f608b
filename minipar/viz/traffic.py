"""The traffic matrix: how many bytes each rank sent to each other rank, by group.

    fig = plot_traffic(report)          # one heatmap per group kind that sent bytes
    fig.savefig("traffic.png")
    plot_sent_bytes(report, by="op")    # each rank's bytes sent, stacked by collective
    cross_node_bytes(traffic_of(report), gpus_per_node=4)   # bytes that leave a node

Cell [i, j] of a heatmap is the bytes rank i (row) sent to rank j (column) per optimizer
step, as the ring algorithm moves them (minipar.distributed books every collective's bytes
per peer). One panel per group kind: the TP group's all-reduces show up as blocks of
neighbouring ranks, the pipeline's sends as single off-diagonal cells, the DP group's
all-reduce (or ZeRO's reduce-scatter and all-gather) as a stripe between distant ranks.
Dashed lines mark node boundaries: the cells that cross them use the slow network.

Built on `matplotlib.figure.Figure`, never pyplot.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from minipar.train.report import Report
from minipar.viz.agg import FIGURE_WIDTH, fixed_margins
from minipar.viz.tables import BINARY_UNITS, byte_unit, human_bytes
from minipar.viz.ticks import TICK_COPYING, TickCopyingAxes, label_every

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


def plot_traffic(report, *, title: str | None = None, annotate: bool | None = None,
                 width: float | None = None, gpus_per_node: int | None = None) -> Figure:
    """One heatmap per group kind of the bytes rank i sent to rank j per step.
    annotate: write the bytes in the cells (default: when there are at most 8 ranks);
    width: inches (default 3.6 per panel, plus the colour bar); gpus_per_node: where to
    draw the node boundaries (default: the report's layout)."""
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
    n = len(matrices)
    fig, axes, bar_axes = _layout(n, width)
    per_node = gpus_per_node or (report.layout or {}).get("gpus_per_node", world)
    image = None
    # A panel's side (1.8-2.4 in) has room for side / LABEL_PITCH_IN rank labels: past
    # that, every k-th rank is labelled (and ticked).
    side = axes[0].get_position().width * fig.get_size_inches()[0]
    # Past MAX_NODE_LINES nodes a side the dashes form a mesh over cells ~2 px wide (128
    # ranks, 4 per node): the title says where the nodes end instead.
    nodes = -(-world // per_node)
    boundaries = range(per_node, world, per_node) if nodes <= MAX_NODE_LINES else ()
    labelled = range(0, world, label_every(world, int(side / LABEL_PITCH_IN)))
    for ax, (kind, matrix) in zip(axes, matrices.items(), strict=True):
        shown = np.ma.masked_where(matrix <= 0, matrix)
        image = ax.imshow(shown, cmap="viridis", norm=norm)
        ax.set_facecolor("#f2f2f2")
        # y=1.0: where matplotlib puts a title with no ticks above the axes; said, it
        # spares measuring every tick label on each draw to find that out.
        ax.set_title(f"{GROUP_TITLES[kind]}\n{human_bytes(matrix.sum())} per step in total",
                     fontsize=8, y=1.0)
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
        for boundary in boundaries:
            ax.axhline(boundary - 0.5, color="black", linestyle="--", linewidth=0.8)
            ax.axvline(boundary - 0.5, color="black", linestyle="--", linewidth=0.8)
        if annotate:
            for i, j in zip(*np.nonzero(matrix), strict=True):
                light = norm(matrix[i, j]) > 0.6
                ax.text(j, i, cell_bytes(matrix[i, j]), ha="center", va="center",
                        fontsize=6, color="black" if light else "white")
    bar = fig.colorbar(image, cax=bar_axes)
    bar.set_label("bytes sent per step", fontsize=8)
    # A few labelled ticks spread evenly on the log scale, in KiB / MiB; no minor ticks
    # (a log axis makes dozens, unlabelled, each costing a redraw).
    bar.ax.minorticks_off()
    bar.ax.tick_params(labelsize=7)
    bar.set_ticks(np.geomspace(norm.vmin, norm.vmax, 4) if norm.vmax > norm.vmin
                  else [norm.vmin])
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(value)))
    nodes_said = ("dashed lines = node boundaries" if nodes <= MAX_NODE_LINES else
                  f"{nodes} nodes of {per_node} ranks (boundaries not drawn)")
    fig.suptitle(title or "traffic matrix: bytes rank i (row) sent to rank j (column); "
                          + nodes_said, fontsize=9)
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


def _layout(n: int, width: float | None):
    """A figure of n square panels side by side and a colour bar, with fixed margins:
    (figure, panel axes, colour-bar axes). Panels are 2.8 in unless `width` (inches)
    says how wide the whole figure is (default: 2.4 in panels, at most 8 in in all, so
    that a notebook shows 7 pt labels at ~10 px)."""
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
    height = TOP + side + BOTTOM
    fig = Figure(figsize=(width, height))
    axes = [fig.add_axes(((left + k * (side + GAP)) / width, BOTTOM / height, side / width,
                          side / height), axes_class=TickCopyingAxes) for k in range(n)]
    bar_left = left + n * side + GAP * (n - 1) + BAR_GAP
    bar_axes = fig.add_axes((bar_left / width, BOTTOM / height, BAR / width, side / height),
                            label="<colorbar>", axes_class=TickCopyingAxes)
    return fig, axes, bar_axes


# ------------------------------------------------------------------ per rank, the totals
def traffic_of(report: Report) -> np.ndarray:
    """The rank x rank matrix of bytes sent ([i, j]: rank i to rank j) of a run."""
    if not report.traffic or "matrix" not in report.traffic:
        raise ValueError("this report carries no traffic matrix (report.traffic); it "
                         "comes from minipar.train.train")
    return np.asarray(report.traffic["matrix"], dtype=np.int64)


def plot_sent_bytes(report: Report, *, by: str = "group",
                    width: float = FIGURE_WIDTH) -> Figure:
    """Each rank's bytes sent per optimizer step, stacked by group kind (by="group":
    dp / tp / pp) or by collective (by="op"), from the report's ranks[i]["comm"]."""
    if by not in ("group", "op"):
        raise ValueError(f"plot_sent_bytes: by must be 'group' or 'op', got {by!r}")
    steps = max(1, len(report.steps))
    key, colors = ("by_group", GROUP_COLORS) if by == "group" else ("by_op", OP_COLORS)
    names = sorted({name for r in report.ranks for name, b in r["comm"][key].items() if b},
                   key=lambda name: list(colors).index(name) if name in colors else 99)
    n = len(report.ranks)
    unit, scale = byte_unit(max(max(r["comm"]["sent_bytes"] for r in report.ranks), 1)
                             / steps)
    fig = Figure(figsize=(width, 2.8))
    ax = fig.subplots(subplot_kw=TICK_COPYING)
    fixed_margins(fig, left=0.75, right=1.4, bottom=0.75, top=0.3)
    sent = {name: np.array([r["comm"][key].get(name, 0) for r in report.ranks])
            for name in names}  # bytes per rank, over all steps
    total = sum(per_rank.sum() for per_rank in sent.values())
    bottom = np.zeros(n)
    for name, per_rank in sent.items():
        values = per_rank / steps / scale
        # An op of a few bytes (the loss's all-reduce: 16 B beside 700 KiB) has a legend
        # entry and no visible bar: the label says why.
        label = name if per_rank.sum() >= 0.01 * total else f"{name} (<1%)"
        ax.bar(range(n), values, bottom=bottom, label=label, width=0.7,
               color=colors.get(name, "#777777"))
        bottom += values
    # From 0: autoscaling stops the axis at a sticky edge near it when the lowest bars are
    # that thin (7.6e-06 MiB at dp 8, by op), and the 0 tick went missing.
    ax.set_ylim(bottom=0)
    every = label_every(n, BAR_LABELS_MOST)
    ax.set_xticks(range(n), [coords_label(r) if r["rank"] % every == 0 else ""
                             for r in report.ranks], fontsize=7)
    ax.set_xlabel("rank, dp/pp/tp", fontsize=8)
    ax.set_ylabel(f"bytes sent per step ({unit})")
    ax.set_title(f"each rank's bytes sent per step, by {by}", fontsize=9, y=1.0)
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
