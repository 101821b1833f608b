"""The ring all-reduce, step by step: which chunk every rank sends, and what it holds.

    fig = plot_ring(4)                 # 4 ranks, a tensor cut in 4 chunks
    picture = ring_picture(4)          # the same as data

The chunk each position sends and receives at each step is `all_reduce_chunks`, the
function `ring_all_reduce` itself runs (minipar/distributed/ring.py); what travels, and
when, is read from the byte ledgers of a real `ring_all_reduce` on n virtual ranks. One
row per rank, one column per step: after each step the rank's n chunks, each shaded by
how many ranks' contributions it sums (pale: only my own, dark: all n), the chunk it
just sent outlined, an arrow to its successor. n-1 reduce-scatter steps leave each rank
one complete chunk; n-1 all-gather steps pass the complete chunks around once.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from minipar import distributed as dist
from minipar.distributed.ring import all_reduce_chunks

CHUNK_BYTES = 1024  # per chunk of the measured run (float32)
SHADES = LinearSegmentedColormap.from_list("summed", ["#e8eef6", "#1f4e89"])


def _measured_ring(n: int) -> list[list[tuple[int, int, float, float]]]:
    """Per rank, (destination, bytes, start, end) of each send of one ring_all_reduce of
    n chunks over n virtual ranks, in order."""

    def rank():
        dist.ring_all_reduce(np.ones(n * CHUNK_BYTES // 4, np.float32))
        return [(r.sent_to[0][0], r.sent_bytes, r.start, r.end)
                for r in dist.get_device().comm.records if r.op == "send"]

    return dist.launch(rank, n)


def ring_picture(n: int = 4) -> dict:
    """Per step and rank: the chunk sent (and to whom, how many bytes, from the ledger),
    and after the step the set of ranks whose contributions each of its chunks sums."""
    sends = _measured_ring(n)
    holds = [[{i} for _ in range(n)] for i in range(n)]  # holds[i][k]: ranks summed
    steps = []
    for step in range(2 * (n - 1)):
        moves = [all_reduce_chunks(i, n, step) for i in range(n)]
        sent = [set(holds[i][moves[i][0]]) for i in range(n)]
        for i in range(n):  # position i receives from its predecessor
            source = (i - 1) % n
            received = moves[i][1]
            holds[i][received] = (holds[i][received] | sent[source] if step < n - 1
                                  else set(sent[source]))
        steps.append({
            "phase": "reduce-scatter" if step < n - 1 else "all-gather",
            "sends": [{"chunk": moves[i][0], "to": sends[i][step][0],
                       "bytes": sends[i][step][1]} for i in range(n)],
            "holds": [[sorted(chunk) for chunk in holds[i]] for i in range(n)]})
    per_rank = sum(b for _, b, _, _ in sends[0])
    return {"figure": "ring", "n": n, "chunk_bytes": sends[0][0][1], "steps": steps,
            "sent_per_rank": per_rank,
            "title": f"ring all-reduce over {n} ranks: {n - 1} reduce-scatter steps, then "
                     f"{n - 1} all-gather steps, one chunk of S/{n} sent per step"}


def plot_ring(n: int = 4) -> Figure:
    return draw_ring(ring_picture(n))


def draw_ring(picture: dict, width: float = 10.0) -> Figure:
    """One column per step, one row per rank: the rank's chunks after the step, shaded by
    how many ranks each sums; the chunk sent outlined in red, an arrow to the same chunk
    of the successor (the last rank's goes round to rank 0: the short arrows at the top
    and bottom)."""
    n, steps = picture["n"], picture["steps"]
    gap = 0.6  # between rows, for the arrows
    fig = Figure(figsize=(width, 0.6 * n + 1.3))
    ax = fig.add_axes((0.07, 0.02, 0.92, 0.74))
    cell = n + 1.2  # a column: n chunks and a gap
    for column, step in enumerate(steps):
        x0 = column * cell
        ax.text(x0 + n / 2, -0.55, f"step {column + 1}: {step['phase']}", ha="center",
                va="bottom", fontsize=8)
        for i in range(n):
            y = i * (1 + gap)
            for k, ranks in enumerate(step["holds"][i]):
                share = len(ranks) / n
                ax.add_patch(Rectangle((x0 + k, y), 0.9, 1, facecolor=SHADES(share),
                                       edgecolor="white"))
                ax.text(x0 + k + 0.45, y + 0.5, str(len(ranks)), ha="center", va="center",
                        fontsize=7, color="white" if share > 0.5 else "black")
            sent = step["sends"][i]
            k = sent["chunk"]
            ax.add_patch(Rectangle((x0 + k, y), 0.9, 1, fill=False, edgecolor="#c03d3e",
                                   linewidth=1.6))
            if sent["to"] == (i + 1) % n and i + 1 < n:  # down to the successor's chunk k
                ends = (y + 1.02, y + 1 + gap - 0.02)
            else:  # round the ring: out at the bottom, in at the top of rank 0
                ends = (y + 1.02, y + 1 + gap * 0.8)
                ax.add_patch(FancyArrowPatch((x0 + k + 0.45, -gap * 0.8),
                                             (x0 + k + 0.45, -0.02), arrowstyle="-|>",
                                             mutation_scale=7, color="#c03d3e",
                                             linewidth=0.9))
            ax.add_patch(FancyArrowPatch((x0 + k + 0.45, ends[0]), (x0 + k + 0.45, ends[1]),
                                         arrowstyle="-|>", mutation_scale=7,
                                         color="#c03d3e", linewidth=0.9))
    ax.set_xlim(-0.2, len(steps) * cell)
    ax.set_ylim(n * (1 + gap), -1.1)
    ax.set_yticks([i * (1 + gap) + 0.5 for i in range(n)], [f"rank {i}" for i in range(n)],
                  fontsize=8)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(left=False)
    fig.suptitle(picture["title"] + "\na cell: one chunk after the step, and how many ranks' "
                 "values it sums; red: the chunk sent to the next rank\n"
                 f"measured: {picture['chunk_bytes']} B per chunk, "
                 f"{picture['sent_per_rank']} B sent per rank in all", fontsize=9, y=0.99)
    return fig
