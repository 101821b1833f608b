"""Does a change leave every explorer picture unchanged, pixel for pixel? Show a list of
explorer views, decode each PNG to RGBA and write a SHA-256 digest of the pixels (and of
the status line); run it on two trees, compare.

    python benchmarks/picture_identity.py pictures-branch.json        # this tree
    cd /tmp && PYTHONPATH=/path/to/main-tree python /path/to/picture_identity.py pictures-main.json
    python benchmarks/picture_identity.py --compare pictures-main.json pictures-branch.json

(PYTHONPATH wins over an editable install unless the current directory holds another
`minipar`: run the main tree's pass from elsewhere.) The views: every explorer's default,
the settings issue 19 names (sharding dp4 tp4, dp2 tp2 pp2 ZeRO-3 grads, pp4; memory dp8,
dp2 tp2 ZeRO-3, offload; pipeline gpipe, interleaved, p8 m16, zb-h1; traffic by op, two
GPUs per node, four micro-batches) and the explorers the notebooks build, in one process
and in that order, so pictures drawn after others (and the same picture drawn twice) are
compared too. The PNG bytes are digested as well, for information: zlib may encode equal
pixels differently; the pixels are what must not change.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pathlib
import sys

# Draw every picture: answers kept on disk (minipar/viz/store.py) would be read instead.
os.environ["MINIPAR_CACHE_DIR"] = "off"

# (name, explorer class name, constructor settings, then changes made one `set` each)
VIEWS = [
    ("sharding default", "ShardingExplorer", {}, []),
    ("sharding dp4 tp4 pp1", "ShardingExplorer", {}, [dict(dp=4, tp=4, pp=1)]),
    ("sharding dp2 tp2 pp2 zero3 grads", "ShardingExplorer", {},
     [dict(dp=2, tp=2, pp=2, zero=3, kind="grads")]),  # refused: the status line
    ("sharding dp2 tp2 pp1 zero3 grads", "ShardingExplorer", {},
     [dict(dp=2, tp=2, pp=1, zero=3, kind="grads")]),
    ("sharding dp1 tp1 pp4", "ShardingExplorer", {}, [dict(dp=1, tp=1, pp=4)]),
    ("sharding dp4 tp4 params, attn weight", "ShardingExplorer", {},
     [dict(dp=4, tp=4, pp=1, kind="params", tensor="h.0.attn.c_attn.weight")]),
    ("sharding dp4 tp1 pp4 zero1 bias", "ShardingExplorer", {},
     [dict(dp=4, tp=1, pp=4, zero=1, tensor="h.3.mlp.c_fc.bias")]),
    ("memory default", "MemoryExplorer", {}, []),
    ("memory dp8", "MemoryExplorer", {}, [dict(dp=8)]),
    ("memory dp2 tp2 zero3", "MemoryExplorer", {}, [dict(dp=2, tp=2, zero=3)]),
    ("memory offload cpu", "MemoryExplorer", {}, [dict(zero=1, offload_optimizer="cpu")]),
    ("memory offload nvme params, checkpointing", "MemoryExplorer", {},
     [dict(offload_optimizer="nvme", offload_param="cpu", zero=3,
           recompute_granularity="full")]),
    ("pipeline default", "PipelineExplorer", {}, []),
    ("pipeline gpipe", "PipelineExplorer", {}, [dict(schedule="gpipe")]),
    ("pipeline interleaved v2 p4 m8", "PipelineExplorer", {},
     [dict(schedule="interleaved", virtual_stages=2, pp=4, micro_batches=8)]),
    ("pipeline p8 m16", "PipelineExplorer", {}, [dict(pp=8, micro_batches=16)]),
    ("pipeline zb-h1", "PipelineExplorer", {}, [dict(schedule="zb-h1")]),
    ("pipeline p2 m1", "PipelineExplorer", {}, [dict(pp=2, micro_batches=1)]),
    ("traffic default", "TrafficExplorer", {}, []),
    ("traffic by op", "TrafficExplorer", {}, [dict(by="op")]),
    ("traffic dp4 tp4 2 per node", "TrafficExplorer", {},
     [dict(dp=4, tp=4, pp=1, gpus_per_node=2)]),
    ("traffic grad_accum 4", "TrafficExplorer", {}, [dict(grad_accum_steps=4)]),
    # the explorers the notebooks build (grep "Explorer(" notebooks/*.ipynb)
    ("notebook 00 sharding", "ShardingExplorer", dict(dp=2, tp=2, pp=2, zero=1), []),
    ("notebook 03 sharding", "ShardingExplorer",
     dict(dp=4, tp=1, pp=1, zero=2, kind="grads"), []),
    ("notebook 03 memory", "MemoryExplorer", dict(dp=4, zero=3, precision="bf16-mixed"), []),
    ("notebook 05 pipeline", "PipelineExplorer",
     dict(schedule="1f1b", pp=4, micro_batches=8), []),
    ("notebook 05 pipeline zb-v", "PipelineExplorer",
     dict(schedule="zb-v", pp=4, micro_batches=8, virtual_stages=2), []),
    ("notebook 06 memory", "MemoryExplorer",
     dict(dp=2, tp=2, pp=2, zero=1, precision="bf16-mixed"), []),
    ("notebook 06 traffic", "TrafficExplorer",
     dict(dp=2, tp=2, pp=2, zero=1, gpus_per_node=4), []),
    # the first views again, drawn after all the others
    ("sharding default, again", "ShardingExplorer", {}, []),
    ("pipeline default, again", "PipelineExplorer", {}, []),
]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pixels(png: bytes) -> tuple[list[int], str]:
    """(shape, digest) of the PNG decoded to RGBA."""
    import numpy as np
    from PIL import Image

    rgba = np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))
    return list(rgba.shape), digest(np.ascontiguousarray(rgba).tobytes())


def digests(only: str | None = None) -> dict:
    import minipar
    from minipar.viz import widgets

    print(f"minipar from {pathlib.Path(minipar.__file__).parent}", file=sys.stderr)
    out = {}
    for name, cls, initial, changes in VIEWS:
        if only and only not in name:
            continue
        if cls == "PipelineExplorer" and any(c.get("schedule") == "zb-h1" for c in changes):
            from minipar.parallel.pipeline.schedules.registry import schedule_names
            if "zb-h1" not in schedule_names():
                continue
        # a fresh cache per view: every picture drawn, none taken from another view
        explorer = getattr(widgets, cls)(cache=widgets.RunCache(), prefetch=False, **initial)
        for change in changes:
            explorer.set(**change)
        pngs = [image.value for image in explorer._pictures.children]
        out[name] = {"values": repr(explorer.values()), "error": explorer.error,
                     "status": digest(explorer.status.value.encode()),
                     "pictures": [pixels(png) for png in pngs],
                     "png_bytes": [digest(png) for png in pngs]}
        print(name, [p[0] for p in out[name]["pictures"]], explorer.error or "",
              file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="where to write, or two files to compare")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--only", help="only the views whose name contains this")
    args = parser.parse_args()
    if not args.compare:
        pathlib.Path(args.paths[0]).write_text(json.dumps(digests(args.only), indent=1))
        return
    first, second = (json.loads(pathlib.Path(p).read_text()) for p in args.paths)
    different, bytes_differ = [], 0
    for view, fields in first.items():
        other = second.get(view, {})
        wrong = [k for k in fields if k != "png_bytes" and fields[k] != other.get(k)]
        if wrong:
            different.append((view, wrong))
        bytes_differ += fields.get("png_bytes") != other.get("png_bytes")
    for view, fields in different:
        print(f"DIFFERENT {view}: {fields}")
    print(f"{len(first) - len(different)} of {len(first)} views pixel-identical, with the "
          f"same status line ({bytes_differ} with other PNG bytes)")
    sys.exit(1 if different or first.keys() != second.keys() else 0)


if __name__ == "__main__":
    main()
