"""One layer, every split: what DP, TP, SP, PP, CP and EP each cut, and which collective
each one adds, in one picture.

    fig = plot_layer_splits()              # 6 runs of a 2-layer model on 2 ranks
    picture = layer_splits_picture()

Every number is measured: each way of splitting trains one step of the same small model
on 2 virtual ranks (the same global batch; EP on a mixture-of-experts version of it)
beside the one-GPU run, and the picture reads rank 0's report: its parameter and
activation bytes as a share of one GPU's (the shaded share of the sketch's activation
tensor X and weight W), and every collective it called, by group, operation and phase
(the report's `transfers`). What a strategy cuts (rows: tokens, columns: hidden units,
layers, experts) is its definition; how much it cut and what it sent are measurements.
"""

from __future__ import annotations

from collections import Counter

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minipar.train import TrainConfig, train
from minipar.viz.tables import human_bytes

MODEL = TrainConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, micro_batch_size=4,
                    global_batch_size=4, steps=1, data="synthetic")
# name: (layout, what it cuts, how the sketch cuts X and W, the group whose calls it adds)
SPLITS = {
    "DP": (dict(dp=2, micro_batch_size=2), "the batch: each rank its own sequences",
           "X rows", "dp"),
    "TP": (dict(tp=2), "each weight matrix: heads, MLP columns / rows", "W columns", "tp"),
    "SP (with TP)": (dict(tp=2, sequence_parallel=True),
                     "TP + the sequence between the TP regions (LayerNorm, dropout)",
                     "W columns, X rows", "tp"),
    # one micro-batch here: under 1F1B with m >= p micro-batches stage 0 holds p of them,
    # a whole model's activations (notebook 07, follow-up 2)
    "PP": (dict(pp=2), "the layers: each stage its own blocks (1 micro-batch here; with "
           "m >= p, stage 0 holds p)", "layers", "pp"),
    "CP": (dict(cp=2), "the sequence, in every layer (ring attention; the gradients are "
           "also averaged over cp)", "X rows", "cp"),
    "EP": (dict(dp=2, ep=2, micro_batch_size=2, moe_num_experts=2),
           "the experts of each MoE layer (inside the DP group)", "experts", "ep"),
}
COLORS = {"X": "#8c6bb1", "W": "#3b75af"}


def _calls(report, group: str) -> list[list]:
    """[op, forward calls, backward calls, bytes sent] of rank 0's collectives in `group`
    per step, in the forward and backward passes (the optimizer's few bytes of gradient
    norm and the loss's broadcast left out)."""
    steps = len(report.steps)
    calls, sent = Counter(), Counter()
    for transfer in report.transfers[0]:
        if (transfer["group"] == group and transfer["op"] != "recv"
                and transfer["phase"] in ("forward", "backward")):
            calls[transfer["op"], transfer["phase"]] += 1
            sent[transfer["op"]] += transfer["sent_bytes"]
    return [[op, calls[op, "forward"] // steps, calls[op, "backward"] // steps,
             sent[op] // steps] for op in sorted(sent)]


def layer_splits_picture(model: TrainConfig = MODEL) -> dict:
    """Per way of splitting: what it cuts, rank 0's parameter and activation bytes as a
    share of one GPU's (the same global batch), and its group's calls per step."""
    single = {False: train(model), True: train(model.replace(moe_num_experts=2))}
    rows = []
    for name, (layout, cuts, sketch, group) in SPLITS.items():
        report = train(model.replace(**layout))
        one = single[bool(layout.get("moe_num_experts"))].ranks[0]["memory"]
        mine = report.ranks[0]["memory"]
        rows.append({"name": name, "layout": layout, "cuts": cuts, "sketch": sketch,
                     "group": group,
                     "params": mine["params"] / one["params"],
                     "activations": mine["activations"] / one["activations"],
                     "calls": _calls(report, group),
                     "other_groups": sorted({t["group"] for t in report.transfers[0]}
                                            - {group})})
    return {"figure": "layer_splits", "rows": rows,
            "model": {k: model.to_dict()[k] for k in ("n_layer", "d_model", "seq_len")}}


def plot_layer_splits(model: TrainConfig = MODEL) -> Figure:
    return draw_layer_splits(layer_splits_picture(model))


def _sketch(ax, y: float, row: dict) -> None:
    """X (tokens x hidden) and W (hidden x hidden) of one layer, rank 0's share shaded."""
    x_share, w_share, how = row["activations"], row["params"], row["sketch"]

    def tensor(x0, w, h, color, share, by_rows, label):
        ax.add_patch(Rectangle((x0, y), w, h, facecolor="#eeeeee", edgecolor="black",
                               linewidth=0.6))
        if by_rows:  # a band of rows (tokens) from the top
            ax.add_patch(Rectangle((x0, y), w, h * min(share, 1), facecolor=color))
        else:  # a band of columns (hidden units) from the left
            ax.add_patch(Rectangle((x0, y), w * min(share, 1), h, facecolor=color))
        ax.text(x0 + w / 2, y + h + 0.12, label, ha="center", va="top", fontsize=7)

    if how == "layers":
        for layer in range(2):
            ax.add_patch(Rectangle((0.1 + 1.1 * layer, y + 0.1), 1.0, 0.6,
                                   facecolor=COLORS["W"] if layer == 0 else "#eeeeee",
                                   edgecolor="black", linewidth=0.6))
            ax.text(0.6 + 1.1 * layer, y + 0.4, f"layer {layer}", ha="center", va="center",
                    fontsize=7, color="white" if layer == 0 else "black")
        return
    if how == "experts":
        tensor(0.1, 1.0, 0.7, COLORS["X"], x_share, True, "X")
        for expert in range(2):
            ax.add_patch(Rectangle((1.3 + 0.5 * expert, y + 0.1), 0.4, 0.5,
                                   facecolor=COLORS["W"] if expert == 0 else "#eeeeee",
                                   edgecolor="black", linewidth=0.6))
        ax.text(1.75, y + 0.82, "experts", ha="center", va="top", fontsize=7)
        return
    tensor(0.1, 1.0, 0.7, COLORS["X"], x_share, "X rows" in how, "X (tokens x h)")
    tensor(1.4, 0.7, 0.7, COLORS["W"], w_share if "W" in how else 1.0, False, "W")


def draw_layer_splits(picture: dict, width: float = 10.0) -> Figure:
    rows = picture["rows"]
    fig = Figure(figsize=(width, 0.95 * len(rows) + 0.8))
    ax = fig.add_axes((0.01, 0.01, 0.98, 0.9))
    ax.set_xlim(0, 12)
    ax.set_ylim(len(rows) + 0.1, -0.2)
    ax.axis("off")
    for i, row in enumerate(rows):
        y = i + 0.1
        ax.text(0.0, y + 0.35, row["name"], ha="left", va="center", fontsize=9,
                weight="bold")
        sketch = ax.inset_axes((0.1, 1 - (i + 0.95) / (len(rows) + 0.3), 0.2,
                                0.8 / (len(rows) + 0.3)), transform=ax.transAxes)
        sketch.set_xlim(0, 2.3)
        sketch.set_ylim(1.0, -0.05)
        sketch.axis("off")
        _sketch(sketch, 0.05, row)
        layout = " ".join(f"{k}={v}" for k, v in row["layout"].items()
                          if k not in ("micro_batch_size",))
        ax.text(3.9, y + 0.12, f"cuts {row['cuts']}", fontsize=8, va="center")
        ax.text(3.9, y + 0.42, f"{layout}: rank 0 holds {row['params']:.2f} of one GPU's "
                f"parameters, {row['activations']:.2f} of its activations", fontsize=8,
                va="center")
        calls = "; ".join(f"{op} {forward}+{backward} ({human_bytes(b)})"
                          for op, forward, backward, b in row["calls"]) or "nothing"
        ax.text(3.9, y + 0.72, f"adds in its {row['group']} group: {calls}",
                fontsize=7.5, va="center", color="#c03d3e")
    model = picture["model"]
    fig.suptitle(f"one layer, every split: a {model['n_layer']}-layer model (h = "
                 f"{model['d_model']}, s = {model['seq_len']}) on 2 ranks, the same global "
                 "batch, each number measured\nshaded: rank 0's share of the activations X "
                 "and weights W; red: its calls per step (forward+backward), bytes sent",
                 fontsize=9, y=0.995)
    return fig
