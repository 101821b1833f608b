"""The numbers the explorers' pictures show, read off their matplotlib figures, for the
settings the notebooks open on and the changes they suggest: to compare two trees.

    python benchmarks/explorer_numbers.py numbers-branch.json
    cd /tmp && PYTHONPATH=/path/to/main python /path/to/explorer_numbers.py numbers-main.json
    python benchmarks/explorer_numbers.py --compare numbers-main.json numbers-branch.json

For each view: the status line, and from every figure `explorer.figures` gives (on a tree
whose explorers draw PNGs, the figures of those PNGs; on one that draws in the browser,
the same data drawn by matplotlib: tests/viz/test_pictures.py checks that the browser is
given that data) the titles and tick labels, every bar's height, every image's array
(a heatmap's bytes, a sharding mask), every polygon's corners and colour (a timeline's
intervals) and every text. The data, not the pixels: the browser draws them its own way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("MINIPAR_CACHE_DIR", "off")

# (explorer, constructor arguments): the seven explorers of notebooks 00, 03, 05 and 06,
# then the changes their text suggests ("try ZeRO 0 to 3", "the three kinds of state",
# "its offload switches", schedules, p and m, layouts and micro-batches).
VIEWS = [
    ("TrafficExplorer", dict(dp=2, tp=2, pp=2, zero=1)),                       # 00
    ("ShardingExplorer", dict(dp=4, tp=1, pp=1, zero=2, kind="grads")),        # 03
    ("MemoryExplorer", dict(dp=4, zero=3, precision="bf16-mixed")),            # 03
    ("PipelineExplorer", dict(schedule="1f1b", pp=4, micro_batches=8)),        # 05
    ("PipelineExplorer", dict(schedule="zb-v", pp=4, micro_batches=8, virtual_stages=2)),
    ("MemoryExplorer", dict(dp=2, tp=2, pp=2, zero=1, precision="bf16-mixed",  # 06
                            grad_accum_steps=4)),
    ("TrafficExplorer", dict(dp=2, tp=2, pp=2, zero=1, gpus_per_node=4,
                             precision="bf16-mixed", grad_accum_steps=4)),
    *[("ShardingExplorer", dict(dp=4, tp=1, pp=1, zero=z, kind=k))
      for z in (0, 1, 3) for k in ("params", "grads", "optimizer")],
    ("ShardingExplorer", dict(dp=2, tp=2, pp=2, zero=1, tensor="h.1.attn.c_attn.weight")),
    *[("MemoryExplorer", dict(dp=4, zero=z, precision="bf16-mixed")) for z in (0, 1, 2)],
    ("MemoryExplorer", dict(dp=4, zero=3, precision="bf16-mixed", offload_optimizer="cpu")),
    ("MemoryExplorer", dict(dp=4, zero=3, precision="bf16-mixed", offload_optimizer="nvme",
                            offload_param="cpu")),
    ("MemoryExplorer", dict(dp=8, tp=2, zero=1, recompute_granularity="full")),
    *[("PipelineExplorer", dict(schedule=s, pp=4, micro_batches=8))
      for s in ("gpipe", "zb-h1", "zb-h2")],
    ("PipelineExplorer", dict(schedule="interleaved", pp=4, micro_batches=8,
                              virtual_stages=2)),
    ("PipelineExplorer", dict(schedule="1f1b", pp=8, micro_batches=16)),
    ("TrafficExplorer", dict(dp=4, tp=4, pp=1, zero=1, grad_accum_steps=4, by="op")),
    ("TrafficExplorer", dict(dp=8, tp=2, pp=2, zero=0, gpus_per_node=8)),
]


def numbers(fig) -> dict:
    """What one matplotlib figure shows, as JSON (once drawn: a colour bar colours its
    scale as it draws)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    axes = []
    for ax in fig.axes:
        axes.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
            "yticklabels": [t.get_text() for t in ax.get_yticklabels()],
            "bars": [[float(p.get_x()), float(p.get_y()), float(p.get_width()),
                      float(p.get_height())] for c in ax.containers for p in c],
            "lines": [np.asarray(line.get_ydata(), float).tolist() for line in ax.lines
                      if line.get_linestyle() == "-"],
            "images": [np.ma.filled(np.ma.asarray(im.get_array(), float), 0.0).tolist()
                       for im in ax.images],
            "polygons": [[np.round(np.asarray(path.vertices, float), 12).tolist()
                          for path in c.get_paths()] for c in ax.collections
                         if hasattr(c, "get_paths") and c.get_paths()],
            "colors": [np.round(c.get_facecolor(), 6).tolist() for c in ax.collections
                       if hasattr(c, "get_paths") and c.get_paths()],
            "texts": sorted(t.get_text() for t in ax.texts),
        })
    return {"axes": axes, "texts": sorted(t.get_text() for t in fig.texts),
            "suptitle": fig._suptitle.get_text() if fig._suptitle is not None else ""}


def collect() -> dict:
    from minipar.viz import widgets

    out = {}
    for name, arguments in VIEWS:
        explorer = getattr(widgets, name)(prefetch=False, **arguments)
        label = f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
        out[label] = {"status": explorer.status.value, "error": explorer.error,
                      "figures": [numbers(fig) for fig in explorer.figures]}
        print(f"{label}: {len(out[label]['figures'])} figures", file=sys.stderr)
    return out


def _where(x, y, path: str = "") -> str | None:
    """The first place where two JSON values differ, or None."""
    if type(x) is not type(y):
        return path or "/"
    if isinstance(x, dict):
        for key in x:
            found = _where(x[key], y.get(key), f"{path}/{key}") if key in y else f"{path}/{key}"
            if found:
                return found
        return None
    if isinstance(x, list):
        if len(x) != len(y):
            return f"{path} (length {len(x)} vs {len(y)})"
        return next((found for i, (p, q) in enumerate(zip(x, y, strict=True))
                     if (found := _where(p, q, f"{path}[{i}]"))), None)
    return None if x == y else path


def compare(a: dict, b: dict) -> int:
    """Print the views whose figures differ (where first) and those whose status line
    does; the number of views that differ in either."""
    figures = status = 0
    for label in a:
        if label not in b:
            print(f"only in the first: {label}")
            figures += 1
            continue
        if a[label]["figures"] != b[label]["figures"] or a[label]["error"] != b[label]["error"]:
            figures += 1
            print(f"figures differ: {label} at {_where(a[label]['figures'], b[label]['figures'])}")
        if a[label]["status"] != b[label]["status"]:
            status += 1
            print(f"status differs: {label}\n  {a[label]['status'][:160]}\n  "
                  f"{b[label]['status'][:160]}")
    print(f"{len(a) - figures} of {len(a)} views' figures show the same numbers; "
          f"{len(a) - status} status lines read the same")
    return figures + status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="write the numbers here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="compare two files written by this script")
    args = parser.parse_args()
    if args.compare:
        first, second = (json.load(open(path, encoding="utf-8")) for path in args.compare)
        sys.exit(1 if compare(first, second) else 0)
    if not args.out:
        parser.error("give a file to write, or --compare A B")
    with open(args.out, "w", encoding="utf-8") as file:
        json.dump(collect(), file)


if __name__ == "__main__":
    main()
