"""Tensor parallelism's two splits and its two operators, f and g, in one picture.

    fig = plot_tensor_split(2)            # the MLP of block 0 over t = 2 ranks
    picture = tensor_split_picture(2)     # the same as data

Drawn from what the trainer builds and calls, never from a formula:
- which elements of the MLP's two weights each rank holds: the training loop's own
  builder on t virtual ranks (`minipar.viz.sharding.holdings`): c_fc (A, d x 4d) by
  columns, c_proj (B, 4d x d) by rows (Megatron's column- and row-parallel layers);
- what f and g send: the collectives that one more transformer layer adds on a rank of
  a tensor-parallel GPT (`tensor_parallel_gpt`, one forward and backward), by phase.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, Rectangle

from minipar import distributed as dist
from minipar.nn import GPTConfig
from minipar.parallel.tensor.model import tensor_parallel_gpt
from minipar.train.config import TrainConfig
from minipar.viz.sharding import holdings

RANK_COLORS = ("#3b75af", "#e1812c", "#3a923a", "#8c6bb1", "#c03d3e", "#8c564b",
               "#e377c2", "#7f7f7f")
MODEL = TrainConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, micro_batch_size=2)


def layer_collectives(t: int, sequence_parallel: bool = False, *, b: int = 2, s: int = 16,
                      h: int = 32) -> dict[tuple[str, str], tuple[int, int]]:
    """{(op, phase): (calls, bytes sent)} that one more transformer layer adds on rank 0
    of a tensor-parallel GPT over t ranks, for one forward and backward of a (b, s) batch
    of width h in fp32: the difference of 2 layers and 1."""
    tokens = np.random.default_rng(0).integers(0, 32, (2, b, s))

    def records(n_layer: int):
        config = GPTConfig(vocab_size=32, seq_len=s, n_layer=n_layer, n_head=4, d_model=h)

        def rank():
            group = dist.DeviceMesh(tp=t).tp_group()
            model = tensor_parallel_gpt(config, 0, "fp32", group,
                                        sequence_parallel=sequence_parallel)
            with dist.phase("forward"):
                loss = model(*tokens)
            with dist.phase("backward"):
                loss.backward()

        _, devices = dist.launch(rank, t, return_devices=True)
        return devices[0].comm.records

    one, two = records(1), records(2)
    calls = Counter((r.op, r.phase) for r in two) - Counter((r.op, r.phase) for r in one)
    sent = {key: sum(r.sent_bytes for r in two if (r.op, r.phase) == key)
            - sum(r.sent_bytes for r in one if (r.op, r.phase) == key) for key in calls}
    return {key: (calls[key], sent[key]) for key in sorted(calls)}


def _owners(held, name: str) -> np.ndarray:
    """The full tensor `name`, each element the rank that holds it (-1: none)."""
    owner = np.full(held.shapes[name], -1)
    for rank, masks in enumerate(held.masks):
        mask = masks["params"].get(name)
        if mask is not None:
            owner[mask & (owner < 0)] = rank
    return owner


def tensor_split_picture(t: int = 2, config: TrainConfig = MODEL) -> dict:
    """The owners of block 0's c_fc (A) and c_proj (B) weights on t ranks, each rank's
    piece shape, and the collectives one layer adds per forward and backward."""
    held = holdings(tp=t, config=config)
    a, b = (_owners(held, f"h.0.mlp.{name}.weight") for name in ("c_fc", "c_proj"))
    pieces = [{"A": list(map(int, (held.masks[r]["params"]["h.0.mlp.c_fc.weight"]
                                   .any(axis=1).sum(),
                                   held.masks[r]["params"]["h.0.mlp.c_fc.weight"]
                                   .any(axis=0).sum()))),
               "B": list(map(int, (held.masks[r]["params"]["h.0.mlp.c_proj.weight"]
                                   .any(axis=1).sum(),
                                   held.masks[r]["params"]["h.0.mlp.c_proj.weight"]
                                   .any(axis=0).sum())))} for r in range(t)]
    collectives = [[op, phase, calls, nbytes] for (op, phase), (calls, nbytes)
                   in layer_collectives(t).items()]
    return {"figure": "tensor_split", "t": t, "d": config.d_model,
            "A": a.tolist(), "B": b.tolist(), "pieces": pieces, "collectives": collectives}


def plot_tensor_split(t: int = 2, config: TrainConfig = MODEL) -> Figure:
    return draw_tensor_split(tensor_split_picture(t, config))


def draw_tensor_split(picture: dict, width: float = 10.0) -> Figure:
    """Top: the full A and B, each element coloured by the rank that holds it. Bottom: one
    row per rank, X -> f -> X A_i -> GELU -> (.) B_i -> g -> Y, with what f and g sent."""
    t = picture["t"]
    colors = ListedColormap(RANK_COLORS[:t])
    fig = Figure(figsize=(width, 3.4 + 0.55 * t))
    top_a = fig.add_axes((0.06, 0.56, 0.5, 0.27))
    top_b = fig.add_axes((0.64, 0.56, 0.09, 0.27))
    for ax, name, what in ((top_a, "A", "A = c_fc.weight (d x 4d): split by columns"),
                           (top_b, "B", "B = c_proj.weight\n(4d x d): by rows")):
        owner = np.asarray(picture[name])
        ax.imshow(owner, cmap=colors, vmin=-0.5, vmax=t - 0.5, aspect="auto",
                  interpolation="nearest")
        ax.set_title(what, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    key = fig.add_axes((0.755, 0.56, 0.235, 0.27))
    key.axis("off")
    for r in range(t):
        key.add_patch(Rectangle((0, 0.85 - 0.16 * r), 0.12, 0.1, color=RANK_COLORS[r],
                                transform=key.transAxes))
        shape_a, shape_b = picture["pieces"][r]["A"], picture["pieces"][r]["B"]
        key.text(0.15, 0.9 - 0.16 * r, f"rank {r}: A_{r} {shape_a[0]}x{shape_a[1]}, "
                 f"B_{r} {shape_b[0]}x{shape_b[1]}", fontsize=7.5, va="center",
                 transform=key.transAxes)
    flow = fig.add_axes((0.02, 0.02, 0.96, 0.44))
    flow.axis("off")
    flow.set_xlim(0, 12)
    flow.set_ylim(-1.15, t - 0.3)
    mid = (t - 1) / 2

    def box(x, y, text, color="#dddddd", w=1.2, h=0.6):
        flow.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, facecolor=color,
                                 edgecolor="black", linewidth=0.6))
        flow.text(x, y, text, ha="center", va="center", fontsize=8,
                  color="white" if color != "#dddddd" else "black")

    def arrow(x0, y0, x1, y1):
        flow.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>",
                                       mutation_scale=8, linewidth=0.8))

    box(0.7, mid, "X\n(b, s, d)\nevery rank", w=1.1, h=0.9)
    box(11.3, mid, "Y\n(b, s, d)\nevery rank", w=1.1, h=0.9)
    for x, name in ((2.1, "f"), (9.9, "g")):
        flow.add_patch(Circle((x, mid), 0.33, facecolor="white", edgecolor="#c03d3e",
                              linewidth=1.5))
        flow.text(x, mid, name, ha="center", va="center", fontsize=11, color="#c03d3e",
                  style="italic")
    arrow(1.25, mid, 1.77, mid)
    arrow(10.23, mid, 10.75, mid)
    for r in range(t):
        y = t - 1 - r
        color = RANK_COLORS[r]
        arrow(2.43, mid, 3.2, y)
        box(3.9, y, f"X A_{r}", color)
        arrow(4.5, y, 5.0, y)
        box(5.6, y, "GELU\n(no comm)", w=1.1)
        arrow(6.15, y, 6.6, y)
        box(7.3, y, f"(.) B_{r}\npartial Y", color)
        arrow(7.9, y, 9.57, mid)
    ops = {(op, phase): (calls, nbytes) for op, phase, calls, nbytes in picture["collectives"]}
    lines = {"f": ("identity", "all_reduce", "backward"),
             "g": ("all_reduce", "identity", "forward")}
    for x, name in ((2.1, "f"), (9.9, "g")):
        forward, backward, phase = lines[name]
        calls, nbytes = ops.get(("all_reduce", phase), (0, 0))
        flow.text(x, -0.8, f"{name}: forward {forward}, backward {backward}\nmeasured per "
                  f"layer ({phase}): {calls} all-reduces, {nbytes:,} B\n(one at attention's "
                  "edge, one at the MLP's)", ha="center", va="center", fontsize=7.5)
    fig.suptitle(f"tensor parallelism over t = {t} ranks, block 0's MLP: column-parallel A, "
                 "row-parallel B, nothing sent between them", fontsize=10, y=0.98)
    return fig
