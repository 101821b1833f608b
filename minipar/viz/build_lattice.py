"""Measure every explorer's lattice of settings and write it into the package.

    python -m minipar.viz.build_lattice                  # all of them (~15 min of CPU)
    python -m minipar.viz.build_lattice --only pipeline  # one file (train, pipeline, sharding)

Writes `minipar/viz/lattice/<name>.json.gz` (minipar/viz/lattice.py reads them): for each
setting of the explorers' lattices (`Explorer.lattice`) its result, measured as the
explorer measures it. A file already there is kept for the settings it has, so a build
that stopped goes on where it was; `--fresh` measures everything again (after a change
of what minipar measures: tests/viz/test_lattice.py says when).
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from minipar.viz.lattice import key_text, shipped, write_lattice
from minipar.viz.widgets import (
    MemoryExplorer,
    PipelineExplorer,
    ShardingExplorer,
    TrafficExplorer,
)


def lattices() -> dict:
    """{file name: (Measurements, [settings])} of the default explorers."""
    memory, traffic = MemoryExplorer(prefetch=False), TrafficExplorer(prefetch=False)
    pipeline, sharding = PipelineExplorer(prefetch=False), ShardingExplorer(prefetch=False)
    train = {key_text(values): values for values in memory.lattice() + traffic.lattice()}
    return {"train": (memory.measurements, list(train.values())),
            "pipeline": (pipeline.measurements, pipeline.lattice()),
            "sharding": (sharding.measurements, sharding.lattice())}


def build(name: str, measurements, settings: list[dict], fresh: bool) -> None:
    old = None if fresh else shipped(name)
    model = None if measurements.config is None else measurements.config.to_dict()
    results = ({key: json.loads(text) for key, text in old[1].items()}
               if old and old[0] == model else {})
    wanted = {key_text(values): values for values in settings}
    missing = [values for text, values in wanted.items() if text not in results]
    for values in tqdm(missing, desc=name, unit="setting", file=sys.stderr):
        results[key_text(values)] = measurements.measure(values)
    path = write_lattice(name, model, {key: results[key] for key in wanted})
    print(f"{path}: {len(wanted)} settings, {path.stat().st_size / 1024:.0f} KiB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=("train", "pipeline", "sharding"),
                        help="the files to build (default: all)")
    parser.add_argument("--fresh", action="store_true",
                        help="measure every setting again, not only the missing ones")
    args = parser.parse_args(argv)
    for name, (measurements, settings) in lattices().items():
        if args.only is None or name in args.only:
            build(name, measurements, settings, args.fresh)


if __name__ == "__main__":
    main()
