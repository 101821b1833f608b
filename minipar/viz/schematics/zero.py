"""ZeRO's partitions, stage by stage: which part of the model state each rank keeps.

    fig = plot_zero_partitions(4)          # ZeRO-0..3 on 4 data-parallel ranks
    picture = zero_partitions_picture(4)   # the same as data

The layout of Figure 1 of Rajbhandari et al. 2020 ("ZeRO"), read from the ranks rather
than drawn from the paper: for each stage the training loop's own builder runs on N
virtual ranks (`minipar.viz.sharding.holdings`) and each rank's row shows, over the
whole model laid end to end, the parameters, gradients and optimizer state it keeps
between uses, each segment as wide as its bytes per parameter (bf16-mixed: 2, 2 and 12,
the paper's K = 12). Coloured: held; pale: another rank's shard. The paper draws each
rank's shard as one contiguous piece; the engines cut every bucket N ways (ZeRO-1/2: the
gradient buckets, in backward order; ZeRO-3: each unit, the embeddings, a block, the
head), so a rank's 1/N is a few stripes: the same share, where the code puts it.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minipar.train.config import TrainConfig
from minipar.viz.sharding import KIND_COLORS, KINDS, holdings

MODEL = TrainConfig(n_layer=2, precision="bf16-mixed")
BINS = 160  # slices of the model per segment


def zero_partitions_picture(dp: int = 4, config: TrainConfig = MODEL) -> dict:
    """Per stage 0..3 and rank: the held share of each slice of the model, per kind of
    state, and the bytes the rank holds of each kind (from the engines' own holdings)."""
    stages = []
    for zero in range(4):
        held = holdings(dp=dp, zero=zero, config=config)
        total = held.flat_mask(0, "params").size
        edges = np.linspace(0, total, BINS + 1).astype(int)
        ranks = []
        for rank in range(dp):
            shares = {}
            for kind in KINDS:
                mask = held.flat_mask(rank, kind).astype(float)
                shares[kind] = [round(float(mask[a:b].mean()), 4)
                                for a, b in zip(edges[:-1], edges[1:], strict=True)]
            ranks.append({"shares": shares, "nbytes": held.nbytes[rank]})
        stages.append({"zero": zero, "ranks": ranks, "n_params": int(total)})
    per_param = {kind: stages[0]["ranks"][0]["nbytes"][kind] / stages[0]["n_params"]
                 for kind in KINDS}
    return {"figure": "zero_partitions", "dp": dp, "stages": stages,
            "bytes_per_param": per_param, "precision": config.precision}


def plot_zero_partitions(dp: int = 4, config: TrainConfig = MODEL) -> Figure:
    return draw_zero_partitions(zero_partitions_picture(dp, config))


def draw_zero_partitions(picture: dict, width: float = 10.0) -> Figure:
    dp, stages = picture["dp"], picture["stages"]
    widths = picture["bytes_per_param"]  # each segment as wide as its bytes per parameter
    full = sum(widths.values())
    fig = Figure(figsize=(width, 1.0 + 0.32 * dp * len(stages) + 0.3 * len(stages)))
    ax = fig.add_axes((0.09, 0.06, 0.72, 0.84))
    y = 0.0
    yticks, ylabels = [], []
    for stage in stages:
        ax.text(-0.3, y - 0.15, f"ZeRO-{stage['zero']}", ha="right", va="bottom",
                fontsize=9, weight="bold")
        for rank, row in enumerate(stage["ranks"]):
            x = 0.0
            for kind in KINDS:
                w = widths[kind]
                shade = LinearSegmentedColormap.from_list(kind, ["#f2f2f2", KIND_COLORS[kind]])
                ax.imshow(np.asarray(row["shares"][kind])[None, :], cmap=shade, vmin=0, vmax=1,
                          extent=(x, x + w, y + 0.85, y + 0.05), aspect="auto",
                          interpolation="nearest")
                ax.add_patch(Rectangle((x, y + 0.05), w, 0.8, fill=False, edgecolor="black",
                                       linewidth=0.4))
                x += w
            held = sum(row["nbytes"].values()) / stage["n_params"]
            ax.text(full + 0.3, y + 0.45, f"{held:.2f} B per parameter", va="center",
                    fontsize=8)
            yticks.append(y + 0.45)
            ylabels.append(f"rank {rank}")
            y += 1
        y += 0.6
    ax.set_xlim(0, full)
    ax.set_ylim(y - 0.5, -0.5)
    ax.set_yticks(yticks, ylabels, fontsize=7)
    ax.set_xticks([sum(list(widths.values())[:i]) + w / 2 for i, w in enumerate(widths.values())],
                  [f"{kind}\n{w:g} B" for kind, w in widths.items()], fontsize=8)
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    fig.suptitle(f"ZeRO stages on {dp} data-parallel ranks ({picture['precision']}): what each "
                 "rank keeps of the whole model, read from the ranks\ncoloured: held; pale: "
                 "another rank's shard (the paper's Figure 1); stripes: each bucket (ZeRO-1/2) "
                 "or unit (ZeRO-3) is cut N ways", fontsize=10, y=0.995)
    return fig
