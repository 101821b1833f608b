"""Per-rank memory bars: what each virtual GPU held at its peak, by category.

    fig = plot_memory(report)                        # one bar per rank
    fig = plot_memory(report, baselines={"1 GPU": report.reference})
    fig.savefig("memory.png")
    picture = memory_picture(report)                 # what it draws, as data (JSON)

One stacked bar per rank: what the rank held *at the instant of its peak* (the report's
`memory_at_peak`, by ledger category: params, grads, optimizer, activations, buffers;
measured from the arrays the rank held), so the bar's top is `peak_total`, the memory a
GPU would actually need (the black tick). The categories peak at different instants
(activations at the end of the forward, gradients in the backward), so each category's
own peak is marked apart: a dash of its colour beside the bar, at the height of that
peak measured from zero. Stacking the own peaks instead would draw a bar up to a quarter
taller than anything the rank ever held. Baselines (e.g. the single-device run) are
drawn first, hatched, so a cut is visible at a glance.

With offload (ZeRO-Offload / ZeRO-Infinity), a second panel under the GPU's shows what
each rank keeps behind its GPU: the host (CPU DRAM) tier and the NVMe tier (hatched),
from the report's `memory_host` / `memory_nvme` and what each held at its own peak
(`memory_host_at_peak` / `memory_nvme_at_peak`), in the same categories (so the optimizer
state visibly moves from one panel to the other) and on its own y axis (the few KiB an
NVMe tier holds would vanish on the GPU's MiB). Under, not beside: side by side, two
panels at the width a notebook shows had no room for their rank labels, and a wider
figure is shrunk to fit (its 7 pt text then shows at ~7 display px).

`memory_picture` gives what the figure shows as data, `draw_memory` draws it: an
explorer sends the same data to the browser (minipar/viz/pictures.py), so the two never
disagree. Built on `matplotlib.figure.Figure`, never pyplot.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from minipar.train.report import MEMORY_CATEGORIES
from minipar.viz.ticks import label_every

COLORS = {
    "params": "#3b75af",
    "grads": "#e1812c",
    "optimizer": "#3a923a",
    "activations": "#8c6bb1",
    "buffers": "#999999",
}
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


# Past this many ranks, "rank 3 / 0/1/1" labels run into each other at the width a
# notebook shows (8 in): they become "r3 / 0/1/1", and past twice as many only every k-th
# rank is labelled (ticks.label_every).
COMPACT_LABELS_FROM = 9
LABELLED_RANKS = 16
TIERS_HEIGHT = 7.0  # inches: the GPU panel over the host / NVMe one (an offloaded run)
OWN_PEAK_DASH = (0.39, 0.5)  # x from the bar's centre (bars are 0.7 wide): the own peaks
LEGEND = ([{"label": c, "color": COLORS[c]} for c in MEMORY_CATEGORIES]
          + [{"label": "peak_total", "color": "black"},
             {"label": "own peak", "color": "#555555", "line": True}])


def at_peak(rank: dict, tier: str = "memory") -> dict:
    """What a rank's `tier` ("memory", "memory_host" or "memory_nvme") held at the instant
    of its peak_total, by category: the report's `<tier>_at_peak`."""
    held = rank.get(f"{tier}_at_peak")
    if held is None:
        raise ValueError(f"plot_memory: rank {rank.get('rank')} has no {tier}_at_peak (a "
                         "report of an older minipar): train it again")
    return {c: held[c] for c in MEMORY_CATEGORIES}


def _rows(report) -> list[tuple[str, dict, dict]]:
    """(x label, memory, at peak) per rank: "rank 3" over its mesh coordinates dp/pp/tp,
    "0/1/1" ("r3" for COMPACT_LABELS_FROM ranks or more)."""
    rows = []
    compact = report.world_size >= COMPACT_LABELS_FROM
    for r in report.ranks:
        c = r["coords"]
        label = f"r{r['rank']}" if compact else f"rank {r['rank']}"
        if report.world_size > 1:  # written as the traffic bars and the tables write them
            label += f"\n{c['dp']}/{c['pp']}/{c['tp']}"
        rows.append((label, r["memory"], at_peak(r)))
    return rows


def memory_picture(report, *, baselines: dict | None = None,
                   title: str | None = None) -> dict:
    """What the memory bars show, as data (JSON): the bars of the GPU panel and, with
    offload, of the host / NVMe panel, each bar's bytes per category and its peak_total,
    the unit of each panel's axis, the labels and the legend. `plot_memory` draws it with
    matplotlib, an explorer in the browser (minipar/viz/pictures.js): the same numbers.

    report: a Report (or anything with .ranks and .world_size); baselines: {label:
    Report} drawn first, hatched (their rank 0 only, e.g. {"1 GPU": the single device})."""
    bars = [(label, b.ranks[0]["memory"], at_peak(b.ranks[0]), True)
            for label, b in (baselines or {}).items()]
    bars += [(label, memory, held, False) for label, memory, held in _rows(report)]
    if not bars:
        raise ValueError("plot_memory: the report has no ranks")
    tiers, tiers_per_rank = _tier_bars(report)
    title = title or ("memory per rank: what it held at its peak instant (stacked)\n"
                      "dash beside a bar: a category's own peak (at another instant)")
    gpu = _panel(bars, title, f"peak bytes {'on the GPU' if tiers else 'held'}",
                 "rank, dp/pp/tp" if report.world_size > 1 else None)
    gpu["ticks"] = _ticks(bars)
    panels = [gpu]
    if tiers:
        behind = _panel(tiers, "behind each GPU: host memory, NVMe (hatched)",
                        "peak bytes behind it", None)
        if tiers_per_rank == 1 or len(tiers) < COMPACT_LABELS_FROM:  # "host / rank 3"
            behind["ticks"] = _ticks(tiers)
        else:  # host and NVMe of each rank: the rank under the pair (the legend: hatched)
            pairs = range(0, len(tiers), tiers_per_rank)
            every = label_every(len(pairs), LABELLED_RANKS)
            behind["ticks"] = [[i + (tiers_per_rank - 1) / 2, tiers[i][0].splitlines()[1]]
                               for i in pairs[::every]]
        panels.append(behind)
    legend = LEGEND + [{"label": "NVMe", "color": "white", "hatch": "xx"}] * bool(tiers)
    return {"kind": "bars", "figure": "memory", "layout": "column", "panels": panels,
            "legend": legend}


def memory_comparison_picture(reports: dict, *, rank: int = 0,
                              title: str | None = None) -> dict:
    """One bar per run, side by side: what `rank` of each report held at its peak instant,
    stacked, and each category's own peak beside it (`memory_picture`'s bars), e.g.
    ZeRO-0 to 3 on the same ranks, the paper's Figure 1 measured. reports: {label:
    Report}."""
    bars = [(label, r.ranks[rank]["memory"], at_peak(r.ranks[rank]), False)
            for label, r in reports.items()]
    if not bars:
        raise ValueError("plot_memory_comparison: no reports")
    panel = _panel(bars, title or f"rank {rank} of each run: what it held at its peak "
                   "instant (stacked)\ndashes: each category's own peak", "peak bytes held",
                   None)
    panel["ticks"] = _ticks(bars)
    return {"kind": "bars", "figure": "memory", "layout": "column", "panels": [panel],
            "legend": list(LEGEND)}


def plot_memory_comparison(reports: dict, *, rank: int = 0, title: str | None = None,
                           width: float | None = None) -> Figure:
    """`memory_comparison_picture` drawn by `draw_memory`."""
    return draw_memory(memory_comparison_picture(reports, rank=rank, title=title), width)


def _panel(bars, title: str, ylabel: str, xlabel: str | None) -> dict:
    """One panel of stacked bars: what each bar held at its peak instant by category, the
    peak ticks, each category's own peak (`own_peaks`, the dashes), the hatched bars
    (baselines, NVMe) and the axis unit: its largest unit the tallest bar fills twice."""
    unit, scale = _unit(bars)
    return {"title": title, "ylabel": f"{ylabel} ({unit})", "xlabel": xlabel,
            "unit": unit, "scale": scale, "ymax": 1.05 * _top(bars),
            "series": [{"name": c, "color": COLORS[c],
                        "values": [held[c] for _, _, held, _ in bars]}
                       for c in MEMORY_CATEGORIES],
            "own_peaks": [{"name": c, "color": COLORS[c],
                           "values": [memory[c] for _, memory, _, _ in bars]}
                          for c in MEMORY_CATEGORIES],
            "markers": [memory["peak_total"] for _, memory, _, _ in bars],
            "hatched": [bool(hatched) for _, _, _, hatched in bars]}


def _ticks(bars) -> list:
    """[x, label] of every bar; past LABELLED_RANKS bars only every k-th is labelled."""
    every = label_every(len(bars), LABELLED_RANKS)
    return [[i, label if i % every == 0 else ""] for i, (label, *_) in enumerate(bars)]


def plot_memory(report, *, baselines: dict | None = None, title: str | None = None,
                width: float | None = None) -> Figure:
    """Per rank, its bytes at its peak instant stacked by category (up to its
    peak_total, the black tick), each category's own peak a dash beside the bar.

    report: a Report (or anything with .ranks and .world_size); baselines: {label:
    Report} drawn first (their rank 0 only, e.g. {"1 GPU": single_device_report}).
    Returns a matplotlib.figure.Figure: `memory_picture` drawn by `draw_memory`."""
    return draw_memory(memory_picture(report, baselines=baselines, title=title), width)


def draw_memory(picture: dict, width: float | None = None) -> Figure:
    """The matplotlib figure of a `memory_picture`: one panel of stacked bars, or two
    (the GPU over the host / NVMe tiers) with each its own y scale."""
    panels = picture["panels"]
    count = max(len(p["markers"]) for p in panels)
    width = width or max(6.0, 1.6 + 0.75 * count)
    fig = Figure(figsize=(width, TIERS_HEIGHT if len(panels) > 1 else 4.2),
                 layout="constrained")
    axes = fig.subplots(len(panels), 1) if len(panels) > 1 else [fig.subplots()]
    for ax, panel, hatch in zip(axes, panels, ("//", "xx"), strict=False):
        _stacked(ax, panel, hatch)
        ax.set_xticks([x for x, _ in panel["ticks"]], [label for _, label in panel["ticks"]],
                      fontsize=8)
        if panel["xlabel"]:
            ax.set_xlabel(panel["xlabel"], fontsize=8)
        ax.set_ylabel(panel["ylabel"])
        ax.set_title(panel["title"], fontsize=10, y=1.0)
    handles = [Line2D([], [], color=entry["color"], linewidth=2.5, label=entry["label"])
               if entry.get("line") else
               Patch(facecolor=entry["color"], label=entry["label"],
                     **({"edgecolor": "black", "hatch": entry["hatch"]}
                        if "hatch" in entry else {}))
               for entry in picture["legend"]]
    # Level with the bottom of the bars, not the top: a long title runs past the axes'
    # right edge, and would run under a legend there.
    fig.legend(handles=handles, fontsize=8, loc="outside right lower", frameon=False)
    return fig


def _top(bars) -> float:
    """Bytes of the tallest stack or peak tick among (label, memory, at peak, hatched)
    bars (a category's own peak is never above its rank's peak_total)."""
    return max(max(sum(held.values()), m["peak_total"]) for _, m, held, _ in bars)


def _unit(bars) -> tuple[str, float]:
    """The unit of a panel's y axis: the largest one its tallest bar fills twice."""
    top = _top(bars)
    return next(((u, s) for u, s in UNITS if top >= 2 * s), UNITS[-1])


def _tier_bars(report) -> tuple[list[tuple[str, dict, dict, bool]], int]:
    """(label, memory, at peak, hatched) of each rank's host and NVMe tiers that hold
    bytes, and how many tiers each rank has: "host" over "rank 3" ("r3" for
    COMPACT_LABELS_FROM bars or more)."""
    tiers = []
    for r in report.ranks:
        for tier, name in (("memory_host", "host"), ("memory_nvme", "NVMe")):
            memory = r.get(tier)
            if memory and memory["peak_total"]:
                tiers.append((name, r["rank"], memory, at_peak(r, tier), tier == "memory_nvme"))
    rank = "r{}" if len(tiers) >= COMPACT_LABELS_FROM else "rank {}"
    per_rank = max(1, len(tiers) // max(1, report.world_size))
    return [(f"{name}\n{rank.format(n)}", memory, held, hatched)
            for name, n, memory, held, hatched in tiers], per_rank


def _stacked(ax, panel: dict, hatch: str) -> None:
    """One stacked bar per bar of the panel, categories bottom-up (hatched ones with
    `hatch`), a black tick at its peak_total and, beside it, a dash of each category's
    colour at that category's own peak."""
    scale = panel["scale"]
    for x, peak in enumerate(panel["markers"]):
        heights = [series["values"][x] / scale for series in panel["series"]]
        bottoms = [0.0]
        for height in heights[:-1]:
            bottoms.append(bottoms[-1] + height)
        # One call per bar: the same rectangles in the same order as one call per
        # category, with a fifth of the calls (each has a fixed cost).
        ax.bar([x] * len(heights), heights, bottom=bottoms,
               color=[series["color"] for series in panel["series"]], width=0.7,
               hatch=hatch if panel["hatched"][x] else None, edgecolor="white",
               linewidth=0.5)
        ax.plot([x - 0.38, x + 0.38], [peak / scale] * 2, color="black", linewidth=2)
        for own in panel["own_peaks"]:
            if own["values"][x]:
                ax.plot([x + OWN_PEAK_DASH[0], x + OWN_PEAK_DASH[1]],
                        [own["values"][x] / scale] * 2, color=own["color"], linewidth=2.5,
                        solid_capstyle="butt")
    # Headroom over the tallest bar or tick, as autoscaling gives (5%) unless the top of a
    # stack is an empty category: its rectangle's bottom is a sticky edge there, and the
    # tick sat on the frame (a host tier, whose buffers are empty).
    ax.set_ylim(0, panel["ymax"] / scale)
