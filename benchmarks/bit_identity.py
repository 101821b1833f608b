"""Does a change leave every number a run produces unchanged? Train several layouts and
write a SHA-256 digest of everything each run produced; run it on two trees, compare.

    python benchmarks/bit_identity.py digests-branch.json        # this tree
    PYTHONPATH=/path/to/main-tree python benchmarks/bit_identity.py digests-main.json
    python benchmarks/bit_identity.py --compare digests-main.json digests-branch.json

Digested per layout (2 steps of a small model): the report JSON (losses, grad norms,
ledgers' bytes and peaks, comm logs, simulated clock), the per-rank timelines and
transfers, the final state dict's dtypes, shapes and bytes, and every trace file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import tempfile

LAYOUTS = [
    dict(dp=2, tp=2, pp=2, zero=1),
    dict(dp=4, tp=4, pp=1, zero=0, gpus_per_node=2),
    dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=4, schedule="gpipe"),
    dict(dp=2, tp=1, pp=2, zero=1, schedule="interleaved", virtual_stages=2,
         grad_accum_steps=4, n_layer=4),
    dict(dp=2, tp=2, sequence_parallel=True, zero=2, precision="bf16-mixed"),
    dict(dp=4, zero=3, steps=3, precision="fp64"),
    dict(dp=2, ep=2, moe_num_experts=4, zero=1),
    dict(dp=2, cp=2, tp=1),
    dict(dp=2, tp=2, offload_optimizer="cpu", zero=2, activation_checkpointing=True),
]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digests() -> dict:
    from minipar.train import train

    out = {}
    for layout in LAYOUTS:
        config = {**dict(n_layer=2, steps=2, seq_len=32, d_model=64, n_head=4), **layout}
        with tempfile.TemporaryDirectory() as folder:
            report = train(**config, trace=pathlib.Path(folder))
            traces = {str(p.relative_to(folder)): digest(p.read_bytes())
                      for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}
        state = hashlib.sha256()
        for name, value in sorted(report.state_dict.items()):
            state.update(f"{name} {value.dtype.str} {value.shape}".encode())
            state.update(value.tobytes())
        out[repr(layout)] = {"report": digest(report.to_json().encode()),
                             "timelines": digest(repr(report.timelines).encode()),
                             "transfers": digest(repr(report.transfers).encode()),
                             "state_dict": state.hexdigest(), "traces": traces}
        print(layout, "losses", report.losses, file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="where to write, or two files to compare")
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()
    if not args.compare:
        pathlib.Path(args.paths[0]).write_text(json.dumps(digests(), indent=1))
        return
    first, second = (json.loads(pathlib.Path(p).read_text()) for p in args.paths)
    different = []
    for layout, fields in first.items():
        other = second.get(layout, {})
        if fields != other:
            different.append((layout, [k for k in fields if fields[k] != other.get(k)]))
    for layout, fields in different:
        print(f"DIFFERENT {layout}: {fields}")
    print(f"{len(first) - len(different)} of {len(first)} layouts bit-identical")
    sys.exit(1 if different or first.keys() != second.keys() else 0)


if __name__ == "__main__":
    main()
