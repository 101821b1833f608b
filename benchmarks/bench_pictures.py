"""What an explorer's picture costs, apart from its run: building the figures and
rendering them to PNG, per new setting.

    python benchmarks/bench_pictures.py                  # ~20 s; one JSON line per explorer
    python benchmarks/bench_pictures.py --only sharding
    cd /tmp && PYTHONPATH=/path/to/main-tree python /path/to/bench_pictures.py   # main's

Each explorer (minipar.viz.widgets) takes the path of new settings that
benchmarks/bench_widgets.py takes (one control per change). Every run is measured first
(untimed, and without drawing, so no picture warms a cache the timed ones use); then each
setting's picture is made once, as a reader's change makes it: `build` is the explorer's
`draw` (figures and status line) minus the rendering, `render` the time spent in
`figure_png` (Agg draw + PNG). The first picture (the explorer's default view, drawn
when it is built) is left out: it pays matplotlib's one-time costs (fonts, caches).

A setting is drawn once per process: drawn twice, the second would find caches a new
setting does not. So run the script several times (alternating the trees compared, the
machine is shared) and take medians; `--repeat N` runs N fresh processes itself.
Printed: per explorer, the median and max over its settings, in ms of wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from arguments import positive_int

sys.path.insert(0, str(pathlib.Path(__file__).parent))
# Draw every picture: answers kept on disk (minipar/viz/store.py) would skip the drawing.
os.environ["MINIPAR_CACHE_DIR"] = "off"


def runs(explorer, values: dict) -> None:
    """Measure (and cache) the run behind a setting, drawing nothing."""
    from minipar.parallel.pipeline.schedules.registry import check_schedule_settings

    name = type(explorer).__name__
    if name == "ShardingExplorer":
        explorer.holdings(values["dp"], values["tp"], values["pp"], values["zero"])
    elif name == "PipelineExplorer":
        settings = {k: values[k] for k in ("schedule", "pp", "micro_batches",
                                           "virtual_stages")}
        check_schedule_settings(*settings.values())
        explorer.run(**settings)
    elif name == "TrafficExplorer":
        explorer.run(**{k: v for k, v in values.items() if k != "by"})
    else:
        explorer.run(**values)


def measure(name: str) -> dict:
    from bench_widgets import CASES

    from minipar.viz import explorer as frame
    from minipar.viz.explorer import REFUSALS

    cls, initial, visits, _ = CASES[name]
    explorer = cls(**initial, prefetch=False)  # draws the default view: one-time costs
    settings, values = [], explorer.values()
    for changes in visits:
        for control, value in changes.items():
            values = {**values, control: value}
            settings.append(values)
    drawable = []
    for values in settings:
        try:
            runs(explorer, values)
            drawable.append(values)
        except REFUSALS:
            pass
    rendering = [0.0, 0.0]  # wall, CPU seconds in figure_png
    figure_png = frame.figure_png

    def timed_png(*args, **kwargs):
        started, started_cpu = time.perf_counter(), time.process_time()
        try:
            return figure_png(*args, **kwargs)
        finally:
            rendering[0] += time.perf_counter() - started
            rendering[1] += time.process_time() - started_cpu

    frame.figure_png = timed_png
    times: dict[str, list[float]] = {"build": [], "render": [], "build CPU": [],
                                     "render CPU": []}
    try:
        for values in drawable:
            rendering[:] = [0.0, 0.0]
            started, started_cpu = time.perf_counter(), time.process_time()
            explorer._picture(values)
            wall = time.perf_counter() - started
            cpu = time.process_time() - started_cpu
            times["build"].append((wall - rendering[0]) * 1e3)
            times["render"].append(rendering[0] * 1e3)
            times["build CPU"].append((cpu - rendering[1]) * 1e3)
            times["render CPU"].append(rendering[1] * 1e3)
    finally:
        frame.figure_png = figure_png
    return {"explorer": name, "settings": [repr(v) for v in drawable], **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=["sharding", "memory", "pipeline",
                                                      "traffic"])
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="fresh processes to run (medians over all of them)")
    parser.add_argument("--json", action="store_true", help="print raw JSON lines only")
    args = parser.parse_args()
    if args.json:
        for name in args.only:
            print(json.dumps(measure(name)), flush=True)
        return
    parts = ("build", "render", "build CPU", "render CPU")
    results: dict[str, dict[str, list]] = {}
    for _ in range(args.repeat):
        out = subprocess.run([sys.executable, __file__, "--json", "--only", *args.only],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            row = json.loads(line)
            into = results.setdefault(row["explorer"], {part: [] for part in parts})
            for part in parts:
                into[part].append(row[part])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {args.repeat} processes, load average {load:.2f}; ms per new setting: the "
          "median over processes of each setting, then median / max over the settings")
    print("| explorer | build | render | build + render | CPU: build | render |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, times in results.items():
        per_setting = {part: [statistics.median(column)
                              for column in zip(*times[part], strict=True)]
                       for part in parts}
        both = [b + r for b, r in zip(per_setting["build"], per_setting["render"],
                                      strict=True)]

        def cell(values):
            return f"{statistics.median(values):.0f} / {max(values):.0f}"

        print(f"| {name} | {cell(per_setting['build'])} | {cell(per_setting['render'])} "
              f"| {cell(both)} | {cell(per_setting['build CPU'])} | "
              f"{cell(per_setting['render CPU'])} |")


if __name__ == "__main__":
    main()
