"""Who holds what: the slice of every weight, gradient and Adam moment on each rank.

    held = holdings(dp=2, tp=2, pp=2, zero=1)       # builds the ranks, reads their state
    held.masks[rank]["optimizer"]["h.0.mlp.c_fc.weight"]   # bool array, the full shape
    fig = plot_sharding(held, "optimizer", "h.0.attn.c_attn.weight")

Nothing here is computed from a formula. `holdings` launches the virtual ranks, lets
each one build its share of the model with the training loop's own builder
(`minipar.train.build.build_rank_model`: a pipeline stage of its layers, cut into its
tensor-parallel pieces, wrapped in its DP / ZeRO engine), and then reads which flat
ranges of which tensors the engine keeps (`minipar.parallel.state.holdings`: per
parameter, the range of the parameter, gradient and each optimizer state it holds).
Each holding's placement (Replicate / Shard / StridedShard over the TP group) maps its
local elements back to positions in the full single-device tensor.

The three kinds of state, from one rank's point of view:
    params     the weights it keeps between steps (ZeRO-3: only its shard)
    grads      the gradient it keeps for the optimizer (ZeRO-2/3: only its shard)
    optimizer  Adam's m and v (and fp32 master weights under bf16-mixed)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.colors import LinearSegmentedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.image import BboxImage
from matplotlib.patches import Rectangle
from matplotlib.transforms import Bbox, TransformedBbox

from minipar import distributed as dist
from minipar.autograd.placement import Replicate, shard
from minipar.nn.gpt import parameter_shapes
from minipar.parallel.state import holdings as engine_holdings
from minipar.train.build import build_rank_model
from minipar.train.config import TrainConfig, gpt_config
from minipar.train.data import make_stream
from minipar.train.mixes import check_layout

KINDS = ("params", "grads", "optimizer")
# The memory categories' colours (the memory explorer uses the same ones).
KIND_COLORS = {"params": "#3b75af", "grads": "#e1812c", "optimizer": "#3a923a"}
# The default model with 4 layers, so that pp can be 4.
DEFAULT_CONFIG = TrainConfig(n_layer=4)


@dataclass
class Holdings:
    """What every rank of a dp x pp x tp mesh holds.

    shapes: {name: full shape} in state-dict order; coords: per rank {"dp", "pp", "tp"};
    masks: per rank {kind: {name: bool array of the full shape}} (only the tensors the rank
    holds some of); nbytes: per rank {kind: bytes of the pieces it holds}.
    """

    dp: int
    tp: int
    pp: int
    zero: int
    shapes: dict[str, tuple[int, ...]]
    coords: list[dict[str, int]]
    masks: list[dict[str, dict[str, np.ndarray]]]
    nbytes: list[dict[str, int]]

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def fraction(self, rank: int, kind: str, name: str | None = None) -> float:
        """Share of the full tensor `name` (None: of the whole model) `rank` holds."""
        masks = self.masks[rank][kind]
        names = [name] if name is not None else list(self.shapes)
        held = sum(int(masks[n].sum()) for n in names if n in masks)
        return held / sum(int(np.prod(self.shapes[n])) for n in names)

    def flat_mask(self, rank: int, kind: str) -> np.ndarray:
        """The rank's mask over the whole model, tensors end to end in state-dict order."""
        masks = self.masks[rank][kind]
        return np.concatenate([masks[n].reshape(-1) if n in masks
                               else np.zeros(int(np.prod(s)), dtype=bool)
                               for n, s in self.shapes.items()])


# The engines' holding kinds, by the picture's kind of state.
HOLDING_KINDS = {"params": ("param",), "grads": ("grad",),
                 "optimizer": ("master", "exp_avg", "exp_avg_sq")}


def _rank_state(config: TrainConfig):
    """One rank: build my share of the model and its engine exactly as the training loop
    does (minipar.train.build); return what I hold of each kind of state. The gradient
    is the one the engine keeps for the optimizer: ZeRO-2/3 their shard, DP and ZeRO-1
    the full local gradient backward creates (ZeRO-1 reduce-scatters it after)."""
    mesh = dist.DeviceMesh(dp=config.dp, pp=config.pp, tp=config.tp, cp=config.cp)
    held = engine_holdings(build_rank_model(config, mesh).engine)
    return mesh.coords(), mesh.tp_rank, {
        kind: [h for h in held if h.kind in HOLDING_KINDS[kind]] for kind in KINDS}


def _full_positions(piece, full_shape, tp_rank: int, tp: int) -> np.ndarray:
    """Flat positions in the full tensor of the elements `piece` holds."""
    index = np.arange(int(np.prod(full_shape))).reshape(full_shape)
    if piece.placement_group == "tp" and not isinstance(piece.placement, Replicate):
        index = shard(index, piece.placement, tp_rank, tp)
    return index.reshape(-1)[piece.start:piece.stop]


def holdings(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, *,
             config: TrainConfig = DEFAULT_CONFIG) -> Holdings:
    """Launch dp x pp x tp virtual ranks, build each one's state as `train` would for
    `config` with these sizes, and map what it holds onto the full tensors (see the
    module docstring). A layout training refuses raises the same ConfigError.
    Takes ~0.1 s for 8 ranks of the default model."""
    config = config.replace(dp=dp, tp=tp, pp=pp, zero=zero)
    if config.vocab_size is None:
        config = config.replace(vocab_size=make_stream(config.data).vocab_size)
    check_layout(config)
    results = dist.launch(_rank_state, config.world_size, config,
                          gpus_per_node=config.gpus_per_node)
    shapes = parameter_shapes(gpt_config(config))
    coords, masks, nbytes = [], [], []
    for rank_coords, tp_rank, pieces in results:
        coords.append(rank_coords)
        rank_masks, rank_bytes = {}, {}
        for kind, kind_pieces in pieces.items():
            by_name: dict[str, np.ndarray] = {}
            for piece in kind_pieces:
                mask = by_name.setdefault(piece.name, np.zeros(shapes[piece.name], bool))
                mask.reshape(-1)[_full_positions(piece, shapes[piece.name], tp_rank, tp)] = True
            rank_masks[kind] = by_name
            rank_bytes[kind] = int(sum(piece.nbytes for piece in kind_pieces))
        masks.append(rank_masks)
        nbytes.append(rank_bytes)
    return Holdings(dp, tp, pp, zero, shapes, coords, masks, nbytes)


def holdings_summary(held: Holdings) -> dict:
    """What every rank holds, as JSON: per rank and kind of state the rectangles
    (`rectangles`) of each tensor it holds some of, its coordinates and bytes."""
    return {"dp": held.dp, "tp": held.tp, "pp": held.pp, "zero": held.zero,
            "coords": held.coords, "nbytes": held.nbytes,
            "rects": [{kind: {name: rectangles(mask) for name, mask in masks.items()}
                       for kind, masks in rank.items()} for rank in held.masks]}


def holdings_from_summary(summary: dict, config: TrainConfig = DEFAULT_CONFIG) -> Holdings:
    """The Holdings a `holdings_summary` describes (`config`: the model it was built for)."""
    if config.vocab_size is None:
        config = config.replace(vocab_size=make_stream(config.data).vocab_size)
    shapes = parameter_shapes(gpt_config(config))
    masks = []
    for rank in summary["rects"]:
        rank_masks = {}
        for kind, tensors in rank.items():
            rank_masks[kind] = {}
            for name, rects in tensors.items():
                mask = np.zeros(shapes[name], bool)
                rows = mask.reshape(1, -1) if mask.ndim == 1 else mask
                for r0, r1, c0, c1 in rects:
                    rows[r0:r1, c0:c1] = True
                rank_masks[kind][name] = mask
        masks.append(rank_masks)
    return Holdings(summary["dp"], summary["tp"], summary["pp"], summary["zero"], shapes,
                    summary["coords"], masks, summary["nbytes"])


# ------------------------------------------------------------------ the picture
def _units(shapes: dict) -> list[tuple[str, int, int]]:
    """(label, first flat element, end) of embed / each block / head in the model strip."""
    spans: dict[str, list[int]] = {}
    offset = 0
    for name, shape in shapes.items():
        parts = name.split(".")
        label = ".".join(parts[:2]) if parts[0] == "h" else (
            "embed" if parts[0] in ("wte", "wpe") else "head")
        size = int(np.prod(shape))
        span = spans.setdefault(label, [offset, offset + size])
        span[1] = offset + size
        offset += size
    return [(label, lo, hi) for label, (lo, hi) in spans.items()]


def _grid(summary: dict) -> tuple[int, int]:
    """Rows x columns of the per-rank panels: one row per DP replica (up to 4 columns)."""
    n = summary["dp"] * summary["tp"] * summary["pp"]
    cols = min(4, n) if summary["dp"] == 1 else min(4, summary["tp"] * summary["pp"])
    return -(-n // cols), cols


def shares(summary: dict, shapes: dict, kind: str) -> list[float]:
    """Each rank's share of the whole model's `kind` of state, from a `holdings_summary`
    (the rectangles of one rank never overlap)."""
    total = sum(int(np.prod(s)) for s in shapes.values())
    return [sum((r1 - r0) * (c1 - c0) for rects in rank[kind].values()
                for r0, r1, c0, c1 in rects) / total for rank in summary["rects"]]


def _flat(rank: dict, shapes: dict, offsets: dict, total: int) -> np.ndarray:
    """A rank's mask over the whole model (tensors end to end), from its rectangles."""
    flat = np.zeros(total, bool)
    for name, rects in rank.items():
        shape = shapes[name]
        rows = flat[offsets[name]:offsets[name] + int(np.prod(shape))].reshape(
            (1, -1) if len(shape) == 1 else shape)
        for r0, r1, c0, c1 in rects:
            rows[r0:r1, c0:c1] = True
    return flat


def sharding_picture(summary: dict, shapes: dict, kind: str = "params",
                     tensor: str = "h.0.attn.c_attn.weight", *, bins: int = 400) -> dict:
    """What the sharding picture shows, as data (JSON), from what every rank holds (a
    `holdings_summary`, of a model whose tensors have `shapes`). Top, a strip: every
    rank's share of the whole model (tensors end to end, cut into `bins` slices between
    `edges`), as the elements it holds of each slice ("held"). Below, one panel per rank: the
    rectangles [row0, row1, col0, col1) of `tensor` (full shape; vectors as one row) it
    holds, and the share held. `plot_sharding` draws it with matplotlib, an explorer in
    the browser (minipar/viz/pictures.js)."""
    if kind not in KINDS:
        raise ValueError(f"plot_sharding: kind {kind!r} is not one of {KINDS}")
    if tensor not in shapes:
        raise ValueError(f"plot_sharding: no tensor {tensor!r}; the model has "
                         f"{', '.join(shapes)}")
    sizes = {name: int(np.prod(shape)) for name, shape in shapes.items()}
    offsets = dict(zip(sizes, np.cumsum([0, *sizes.values()])[:-1].tolist(), strict=True))
    total = sum(sizes.values())
    edges = np.linspace(0, total, bins + 1).astype(int)
    shape = shapes[tensor]
    ranks = []
    for r, rank in enumerate(summary["rects"]):
        held = np.add.reduceat(_flat(rank[kind], shapes, offsets, total), edges[:-1])
        rects = rank[kind].get(tensor, [])
        label = _rank_label(r, summary["coords"][r])
        share = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in rects) / sizes[tensor]
        ranks.append({"label": label, "held": held.tolist(), "rects": rects,
                      "title": f"{label}: {share:.0%}"})
    return {"kind": "sharding", "figure": "sharding", "color": KIND_COLORS[kind],
            "bins": bins, "total": total, "edges": edges.tolist(),
            "units": [list(unit) for unit in _units(shapes)],
            "title": f"{kind} held by each rank: the {total:,} parameters end to end, in "
                     f"{bins} slices - dp={summary['dp']} tp={summary['tp']} "
                     f"pp={summary['pp']} ZeRO-{summary['zero']}",
            "tensor_title": f"{tensor} {tuple(shape)}: the elements each rank holds ({kind})",
            "shape": [1, shape[0]] if len(shape) == 1 else list(shape),
            "grid": list(_grid(summary)), "ranks": ranks}


def rectangles(mask: np.ndarray) -> list[list[int]]:
    """The True elements of a 1- or 2-d mask as rectangles [row0, row1, col0, col1) (a
    vector is one row): each row's runs, rows with the same runs in a row merged. A TP
    shard is one rectangle (three for the fused q, k, v), a ZeRO range of it at most
    three more."""
    mask = mask.reshape(1, -1) if mask.ndim == 1 else mask
    rows, cols = mask.shape
    padded = np.zeros((rows, cols + 2), np.int8)
    padded[:, 1:-1] = mask
    changes = np.diff(padded, axis=1)
    # a new block of rows wherever a row's runs differ from the row above
    first = np.flatnonzero(np.r_[True, (mask[1:] != mask[:-1]).any(axis=1)])
    out = []
    for r0, r1 in zip(first, np.r_[first[1:], rows], strict=True):
        starts, = np.nonzero(changes[r0] == 1)
        ends, = np.nonzero(changes[r0] == -1)
        out += [[int(r0), int(r1), int(c0), int(c1)] for c0, c1 in zip(starts, ends,
                                                                        strict=True)]
    return out


def plot_sharding(held: Holdings, kind: str = "params", tensor: str = "h.0.attn.c_attn.weight",
                  *, bins: int = 400, width: float = 10.0) -> Figure:
    """Top: every rank's share of the whole model (tensors end to end, cut into `bins`
    slices; darker = more of that slice held). Bottom: one panel per rank showing which
    elements of `tensor` (full shape; vectors drawn as one row) it holds, with the share
    held above it: `sharding_picture` drawn by `draw_sharding`."""
    return draw_sharding(sharding_picture(holdings_summary(held), held.shapes, kind, tensor,
                                          bins=bins), width)


def draw_sharding(picture: dict, width: float = 10.0) -> Figure:
    """The matplotlib figure of a `sharding_picture`.

    Two axes: `fig.axes[0]` the strip (one image row per rank), `fig.axes[1]` the panels,
    one image per rank in rank order (`fig.axes[1].images[r]`) titled by a text
    "r3 (dp1 pp0 tp1): 50%". Beside the strip, a bar says what its shades mean: the share
    of each slice held (pale: a part, as TP's column shards hold a part of every row;
    dark: all of it). One axes for all panels and margins of fixed inches: one Axes
    (ticks, spines) per rank would crowd a 16-rank figure."""
    ranks = picture["ranks"]
    n = len(ranks)
    rows, cols = picture["grid"]
    cmap = LinearSegmentedColormap.from_list("held", ["#f2f2f2", picture["color"]])
    fig = Figure(figsize=(width, 1.2 + 0.28 * n + 1.5 * rows))
    ax, panels, bar_at, title_at = _fixed_axes(fig, n, rows, cols)

    total, units = picture["total"], picture["units"]
    strip = np.array([rank["held"] for rank in ranks], float) / np.diff(picture["edges"])
    shown = ax.imshow(strip, aspect="auto", cmap=cmap, vmin=0, vmax=1,
                      interpolation="nearest", extent=(0, total, n - 0.5, -0.5))
    _shade_bar(fig, bar_at, shown.cmap, n)
    for _, lo, _ in units[1:]:
        ax.axvline(lo, color="black", linewidth=0.6)
    ax.set_xticks([(lo + hi) / 2 for _, lo, hi in units], [label for label, _, _ in units],
                  fontsize=8)
    ax.set_yticks(range(n), [rank["label"] for rank in ranks], fontsize=7)
    ax.set_title(picture["title"], fontsize=9, y=1.0)

    # Panel of rank r: column r % cols, row r // cols, in data units of the panels'
    # axes (x: one unit per column, y: one per row, downwards), a gap for the title.
    shape = picture["shape"]
    # The limits first: fixed, so each image's extent and frame need not move them.
    panels.set_xlim(0, cols)
    panels.set_ylim(rows + 0.02, 0)  # room for the last row's frame
    for r, rank in enumerate(ranks):
        row, col = divmod(r, cols)
        image = np.zeros(shape)
        for r0, r1, c0, c1 in rank["rects"]:
            image[r0:r1, c0:c1] = 1.0
        x0, x1, y0, y1 = col + 0.02, col + 0.98, row + 0.2, row + 1.0
        panels.imshow(image, aspect="auto", cmap=cmap, vmin=0, vmax=1,
                      interpolation="nearest", extent=(x0, x1, y1, y0))
        panels.add_artist(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False,
                                    edgecolor="black", linewidth=0.8))
        panels.text((x0 + x1) / 2, y0 - 0.03, rank["title"], ha="center", va="bottom",
                    fontsize=8)
    fig.text(0.5, title_at, picture["tensor_title"], ha="center", va="center", fontsize=9)
    return fig


def _fixed_axes(fig: Figure, n: int, rows: int, cols: int):
    """The strip's axes, the panels' axes (no frame: each panel draws its own), the
    strip's colour bar and the height (figure fraction) of the panels' title, with
    margins in inches that fit these labels (what constrained layout finds, give or
    take)."""
    width, height = fig.get_size_inches()
    strip_height = 0.28 * n + 0.1        # inches: one row per rank
    left, right = 1.25, 0.8              # left: the ranks' labels; right: the colour bar
    strip_top = 1 - 0.3 / height         # below the strip's title
    strip_bottom = strip_top - strip_height / height
    strip = fig.add_axes((left / width, strip_bottom, 1 - (left + right) / width,
                          strip_height / height))
    # Below the strip: its tick labels, the tensor's title, then the panels.
    title_at = strip_top - (strip_height + 0.42) / height
    panels_top = strip_top - (strip_height + 0.5) / height
    panels = fig.add_axes((0.15 / width, 0.05 / height, 1 - 0.3 / width,
                           panels_top - 0.05 / height))
    panels.set_axis_off()
    # the bar: 0.1 in right of the strip, 0.1 in wide, its labels in the rest of `right`
    bar_at = (1 - (right - 0.1) / width, strip_bottom, 0.1 / width, strip_height / height)
    return strip, panels, bar_at, title_at


def _shade_bar(fig: Figure, at: tuple, cmap, n: int) -> None:
    """What a shade of the strip means, beside it at `at` (figure fractions): a slice is
    1/bins of the model, and a rank holding a part of it (every row's own columns, say)
    draws it pale. A gradient image, a frame and texts in the figure, not a colour bar's
    Axes: building an Axes costs ~8 ms, a tenth of this picture."""
    x, y, w, h = at
    image = BboxImage(TransformedBbox(Bbox.from_bounds(*at), fig.transFigure), cmap=cmap,
                      norm=Normalize(0, 1), interpolation="nearest", origin="lower")
    image.set_data(np.linspace(0, 1, 64)[:, None])
    fig.add_artist(image)
    fig.add_artist(Rectangle((x, y), w, h, transform=fig.transFigure, fill=False,
                             edgecolor="black", linewidth=0.8))
    gap = 0.05 / fig.get_size_inches()[0]  # inches, as a figure fraction
    for share in ((0, 0.5, 1) if n > 1 else (0, 1)):
        fig.text(x + w + gap, y + share * h, f"{share:.0%}", va="center", fontsize=7)
    # the words beside the tick labels, as long as the strip is tall: 0.66 in for two
    # ranks, ~1.2 in from four; one rank's strip (0.38 in) has no room for any
    words = "share of a slice held" if n >= 4 else "share held" if n > 1 else ""
    if words:
        fig.text(x + w + 9 * gap, y + h / 2, words, rotation=90, ha="center",
                 va="center", fontsize=7)


def _rank_label(rank: int, coords: dict) -> str:
    return f"r{rank} (dp{coords['dp']} pp{coords['pp']} tp{coords['tp']})"
