"""Does a change leave every number a run produces unchanged? Train several layouts and
write a SHA-256 digest of everything each run produced; run it on two trees, compare.

    python benchmarks/bit_identity.py digests-branch.json        # this tree
    PYTHONPATH=/path/to/main-tree python benchmarks/bit_identity.py digests-main.json
    python benchmarks/bit_identity.py --compare digests-main.json digests-branch.json

A change that adds a field on purpose (a report field, a setting, which every report's
config carries) shows everywhere; `--drop NAME` (repeatable) removes every key NAME, at
any depth, from the reports and the trace files before they are digested, so two trees
digested with the same --drop show that nothing else changed:

    python benchmarks/bit_identity.py --wide --drop by_link a.json            # this tree
    PYTHONPATH=/path/to/main-tree python benchmarks/bit_identity.py --wide --drop by_link b.json

Digested per layout (2 steps of a small model): the report JSON (losses, grad norms,
ledgers' bytes and peaks, comm logs, simulated clock), the per-rank timelines and
transfers, the final state dict's dtypes, shapes and bytes, and every trace file.

`--wide` adds what a renovation of the code must leave unchanged: every case of the
equivalence grid (`minipar check`, trained with its check), the layouts of the ZeRO, TP
and pipeline tables of docs/ (each stage and precision, TP with and without SP, every
schedule), and `minipar demo`'s printed lines (its wall-time line dropped) and reports.
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
    dict(dp=2, tp=2, offload_optimizer="cpu", zero=2, recompute_granularity="full"),
]


# The layouts of benchmarks/zero_tables.py, tp_tables.py and zero_bubble_tables.py, at
# the size of LAYOUTS: every ZeRO stage in both precisions with accumulation and
# buckets, TP 2/4 with and without SP, every pipeline schedule.
TABLE_LAYOUTS = [
    *[dict(dp=4, zero=z, precision=p, grad_accum_steps=2, bucket_size_mb=0.02)
      for z in (0, 1, 2, 3) for p in ("bf16-mixed", "fp32")],
    *[dict(tp=t, sequence_parallel=sp, precision="bf16-mixed")
      for t in (2, 4) for sp in (False, True)],
    *[dict(pp=2, n_layer=4, schedule=s, grad_accum_steps=4,
           virtual_stages=2 if s in ("interleaved", "zb-v", "dualpipe-v") else 1)
      for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe-v")],
]


DROPPED: set[str] = set()  # --drop: keys left out of every digested report and trace


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def without_dropped(value):
    """`value` (parsed JSON) without the keys named by --drop, at any depth."""
    if isinstance(value, dict):
        return {k: without_dropped(v) for k, v in value.items() if k not in DROPPED}
    if isinstance(value, list):
        return [without_dropped(v) for v in value]
    return value


def file_digest(path: pathlib.Path) -> str:
    """A file's digest; a JSON file's without the dropped keys when --drop is given."""
    if DROPPED and path.suffix == ".json":
        data = without_dropped(json.loads(path.read_text()))
        return digest(json.dumps(data, sort_keys=True).encode())
    return digest(path.read_bytes())


def report_digests(report) -> dict:
    state = hashlib.sha256()
    for name, value in sorted(report.state_dict.items()):
        state.update(f"{name} {value.dtype.str} {value.shape}".encode())
        state.update(value.tobytes())
    # The config section apart: a renamed or removed setting shows there alone.
    fields = without_dropped(json.loads(report.to_json()))
    config = fields.pop("config", None)
    return {"report": digest(json.dumps(fields, sort_keys=True).encode()),
            "config": digest(json.dumps(config, sort_keys=True).encode()),
            "timelines": digest(repr(report.timelines).encode()),
            "transfers": digest(repr(report.transfers).encode()),
            "state_dict": state.hexdigest()}


def wide_digests() -> dict:
    """The grid's cases, the tables' layouts and the demo."""
    from minipar.demo import run_demo
    from minipar.train import train
    from minipar.train.grid import GRID, run_case

    out = {}
    references: dict = {}
    for case in GRID:
        result = run_case(case, references)
        out[f"grid {case.name}"] = {"equivalence": digest(repr(result.equivalence).encode()),
                                    "refusal": result.refusal or "",
                                    "warnings": digest(repr(result.warnings).encode())}
        print("grid", case.name, "passed" if result.passed else "FAILED", file=sys.stderr)
    for layout in TABLE_LAYOUTS:
        config = {**dict(n_layer=2, steps=2, seq_len=32, d_model=64, n_head=4), **layout}
        out[f"table {layout!r}"] = report_digests(train(**config))
        print("table", layout, file=sys.stderr)
    with tempfile.TemporaryDirectory() as folder:
        result = run_demo(out_dir=folder, echo=lambda line: None,
                          progress=lambda *a, **k: None)
    lines = [line.replace(folder, "<out>") for line in result.lines
             if not line.startswith("(demo took")]
    out["demo"] = {"lines": digest("\n".join(lines).encode()),
                   "report": report_digests(result.report)["report"],
                   "exact": report_digests(result.exact)["report"],
                   "ablations": {name: report_digests(r)["report"]
                                 for name, r in result.ablations.items()}}
    return out


def digests(wide: bool = False) -> dict:
    from minipar.train import train

    out = {}
    for layout in LAYOUTS:
        config = {**dict(n_layer=2, steps=2, seq_len=32, d_model=64, n_head=4), **layout}
        with tempfile.TemporaryDirectory() as folder:
            report = train(**config, trace=pathlib.Path(folder))
            traces = {str(p.relative_to(folder)): file_digest(p)
                      for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}
        out[repr(layout)] = {**report_digests(report), "traces": traces}
        print(layout, "losses", report.losses, file=sys.stderr)
    if wide:
        out.update(wide_digests())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="where to write, or two files to compare")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--wide", action="store_true",
                        help="also the grid, the tables' layouts and the demo (~20 s)")
    parser.add_argument("--drop", action="append", default=[], metavar="NAME",
                        help="leave every key NAME out of the reports and traces digested")
    args = parser.parse_args()
    DROPPED.update(args.drop)
    if not args.compare:
        pathlib.Path(args.paths[0]).write_text(json.dumps(digests(args.wide), indent=1))
        return
    first, second = (json.loads(pathlib.Path(p).read_text()) for p in args.paths)
    different = []
    for layout, fields in first.items():
        other = second.get(layout, {})
        if fields != other:
            different.append((layout, [k for k in fields if fields[k] != other.get(k)]))
    for layout, fields in different:
        print(f"DIFFERENT {layout}: {fields}")
    for layout in sorted(second.keys() - first.keys()):
        print(f"NEW (only in {args.paths[1]}): {layout}")
    print(f"{len(first) - len(different)} of {len(first)} layouts bit-identical")
    sys.exit(1 if different or first.keys() - second.keys() else 0)


if __name__ == "__main__":
    main()
