"""Per-rank memory bars: what each virtual GPU held at its peak, by category.

    fig = plot_memory(report)                        # one bar per rank
    fig = plot_memory(report, baselines={"1 GPU": report.reference})
    fig.savefig("memory.png")

One stacked bar per rank with the peak bytes of each ledger category (params, grads,
optimizer, activations, buffers; measured from the arrays the rank held), and a black
tick at `peak_total`, the largest sum at one instant. The categories peak at different
moments (activations during the forward, optimizer state throughout), so the stack is
an upper bound and the tick is what a GPU would actually need. Baselines (e.g. the
single-device run) are drawn first, hatched, so a cut is visible at a glance.

With offload (ZeRO-Offload / ZeRO-Infinity), a second panel under the GPU's shows what
each rank keeps behind its GPU: the host (CPU DRAM) tier and the NVMe tier (hatched),
from the report's `memory_host` / `memory_nvme`, in the same categories (so the optimizer
state visibly moves from one panel to the other) and on its own y axis (the few KiB an
NVMe tier holds would vanish on the GPU's MiB). Under, not beside: side by side, two
panels at the width a notebook shows had no room for their rank labels, and a wider
figure is shrunk to fit (its 7 pt text then shows at ~7 display px).

Built on `matplotlib.figure.Figure`, never pyplot.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minipar.train.report import MEMORY_CATEGORIES
from minipar.viz.ticks import TICK_COPYING, label_every

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


def _rows(report) -> list[tuple[str, dict]]:
    """(x label, memory) per rank: "rank 3" over its mesh coordinates dp/pp/tp, "0/1/1"
    ("r3" for COMPACT_LABELS_FROM ranks or more)."""
    rows = []
    compact = report.world_size >= COMPACT_LABELS_FROM
    for r in report.ranks:
        c = r["coords"]
        label = f"r{r['rank']}" if compact else f"rank {r['rank']}"
        if report.world_size > 1:  # written as the traffic bars and the tables write them
            label += f"\n{c['dp']}/{c['pp']}/{c['tp']}"
        rows.append((label, r["memory"]))
    return rows


def plot_memory(report, *, baselines: dict | None = None, title: str | None = None,
                width: float | None = None) -> Figure:
    """Stacked per-rank peak bytes by category, with each rank's peak_total marked.

    report: a Report (or anything with .ranks and .world_size); baselines: {label:
    Report} drawn first (their rank 0 only, e.g. {"1 GPU": single_device_report}).
    Returns a matplotlib.figure.Figure."""
    bars = [(label, b.ranks[0]["memory"], True) for label, b in (baselines or {}).items()]
    bars += [(label, memory, False) for label, memory in _rows(report)]
    if not bars:
        raise ValueError("plot_memory: the report has no ranks")
    tiers, tiers_per_rank = _tier_bars(report)
    unit, scale = _unit(bars)

    width = width or max(6.0, 1.6 + 0.75 * max(len(bars), len(tiers)))
    fig = Figure(figsize=(width, TIERS_HEIGHT if tiers else 4.2), layout="constrained")
    if tiers:  # each tier its own y scale: NVMe's few KiB next to a GPU's MiB would vanish
        ax, behind = fig.subplots(2, 1, subplot_kw=TICK_COPYING)
    else:
        ax = fig.subplots(subplot_kw=TICK_COPYING)
    _stacked(ax, bars, scale)
    every = label_every(len(bars), LABELLED_RANKS)
    ax.set_xticks(range(len(bars)), [label if i % every == 0 else ""
                                     for i, (label, _, _) in enumerate(bars)], fontsize=8)
    if report.world_size > 1:
        ax.set_xlabel("rank, dp/pp/tp", fontsize=8)
    ax.set_ylabel(f"peak bytes {'on the GPU' if tiers else 'held'} ({unit})")
    title = title or ("memory per rank: peak of each category (stacked); black tick = "
                      "peak of the total")
    ax.set_title(title, fontsize=10, y=1.0)
    handles = [Patch(facecolor=COLORS[c], label=c) for c in MEMORY_CATEGORIES]
    handles.append(Patch(facecolor="black", label="peak_total"))
    if tiers:
        tier_unit, tier_scale = _unit(tiers)
        _stacked(behind, tiers, tier_scale, hatch="xx")
        if tiers_per_rank == 1 or len(tiers) < COMPACT_LABELS_FROM:  # "host / rank 3"
            every = label_every(len(tiers), LABELLED_RANKS)
            behind.set_xticks(range(len(tiers)), [label if i % every == 0 else ""
                                                  for i, (label, _, _) in enumerate(tiers)],
                              fontsize=8)
        else:  # host and NVMe of each rank: the rank under the pair (the legend: hatched)
            pairs = range(0, len(tiers), tiers_per_rank)
            every = label_every(len(pairs), LABELLED_RANKS)
            behind.set_xticks([i + (tiers_per_rank - 1) / 2 for i in pairs[::every]],
                              [tiers[i][0].splitlines()[1] for i in pairs[::every]],
                              fontsize=8)
        behind.set_ylabel(f"peak bytes behind it ({tier_unit})")
        behind.set_title("behind each GPU: host memory, NVMe (hatched)", fontsize=10,
                         y=1.0)
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx", label="NVMe"))
    # Level with the bottom of the bars, not the top: a long title runs past the axes'
    # right edge, and would run under a legend there.
    fig.legend(handles=handles, fontsize=8, loc="outside right lower", frameon=False)
    return fig


def _top(bars) -> float:
    """Bytes of the tallest stack or peak tick among (label, memory, hatched) bars."""
    return max(max(sum(m[c] for c in MEMORY_CATEGORIES), m["peak_total"]) for _, m, _ in bars)


def _unit(bars) -> tuple[str, float]:
    """The unit of a panel's y axis: the largest one its tallest bar fills twice."""
    top = _top(bars)
    return next(((u, s) for u, s in UNITS if top >= 2 * s), UNITS[-1])


def _tier_bars(report) -> tuple[list[tuple[str, dict, bool]], int]:
    """(label, memory, hatched) of each rank's host and NVMe tiers that hold bytes, and how
    many tiers each rank has: "host" over "rank 3" ("r3" for COMPACT_LABELS_FROM bars or
    more)."""
    tiers = []
    for r in report.ranks:
        for tier, name in (("memory_host", "host"), ("memory_nvme", "NVMe")):
            memory = r.get(tier)
            if memory and memory["peak_total"]:
                tiers.append((name, r["rank"], memory, tier == "memory_nvme"))
    rank = "r{}" if len(tiers) >= COMPACT_LABELS_FROM else "rank {}"
    per_rank = max(1, len(tiers) // max(1, report.world_size))
    return [(f"{name}\n{rank.format(n)}", memory, hatched)
            for name, n, memory, hatched in tiers], per_rank


def _stacked(ax, bars, scale: float, hatch: str = "//") -> None:
    """One stacked bar per (label, memory, hatched), categories bottom-up (hatched ones
    with `hatch`), and a black tick at peak_total."""
    for x, (_, memory, hatched) in enumerate(bars):
        heights = [memory[category] / scale for category in MEMORY_CATEGORIES]
        bottoms = [0.0]
        for height in heights[:-1]:
            bottoms.append(bottoms[-1] + height)
        # One call per bar: the same rectangles in the same order as one call per
        # category, with a fifth of the calls (each has a fixed cost).
        ax.bar([x] * len(heights), heights, bottom=bottoms,
               color=[COLORS[category] for category in MEMORY_CATEGORIES], width=0.7,
               hatch=hatch if hatched else None, edgecolor="white", linewidth=0.5)
        ax.plot([x - 0.38, x + 0.38], [memory["peak_total"] / scale] * 2, color="black",
                linewidth=2)
    # Headroom over the tallest bar or tick, as autoscaling gives (5%) unless the top of a
    # stack is an empty category: its rectangle's bottom is a sticky edge there, and the
    # tick sat on the frame (a host tier, whose buffers are empty).
    ax.set_ylim(0, 1.05 * _top(bars) / scale)
