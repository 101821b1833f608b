"""How long the notebook explorers take to answer a control change.

    python benchmarks/bench_widgets.py            # ~30 s
    python benchmarks/bench_widgets.py --quick    # one setting per explorer

Each explorer (minipar.viz.widgets) is driven headless, as the tests drive it: set a
control's `.value`; the callback runs synchronously (run, draw, PNG), so the wall time of
the assignment is the latency a user sees, minus the browser's drawing of a PNG. Three
cases per explorer:

    new setting       a layout never seen: one measured run (training step / pipeline
                      step / building the ranks) + the figures + PNG encoding
    revisited         a setting seen before: the cached picture, nothing recomputed
    view change       same run, another view (sharding: the state kind; traffic: bars by
                      op; memory and pipeline have none): figures + PNG from a cached run

Reported: median and max over the settings visited, in milliseconds, with the host, so
the figures in benchmarks/README.md can be compared with a rerun. Skips with a message
when ipywidgets is not installed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

try:
    from minipar.viz import widgets
except ImportError as error:  # ipywidgets missing
    print(f"skipped: {error}")
    sys.exit(0)

# (explorer class, initial settings, new settings to visit, a view change or None)
CASES = {
    "sharding": (widgets.ShardingExplorer, dict(dp=2, tp=2, pp=2, zero=1),
                 [dict(zero=0), dict(tp=1), dict(pp=4), dict(dp=4, pp=1), dict(tp=4, dp=2)],
                 ("kind", ["params", "grads", "optimizer"])),
    "memory": (widgets.MemoryExplorer, dict(dp=4, zero=0),
               [dict(zero=1), dict(zero=2), dict(zero=3), dict(dp=8), dict(dp=2, tp=2),
                dict(tp=1, pp=2, zero=1)],
               None),
    "pipeline": (widgets.PipelineExplorer, dict(schedule="1f1b", pp=4, micro_batches=8),
                 [dict(schedule="gpipe"), dict(micro_batches=4), dict(micro_batches=16),
                  dict(pp=8), dict(schedule="interleaved", virtual_stages=2, pp=4,
                                   micro_batches=8)],
                 None),
    "traffic": (widgets.TrafficExplorer, dict(dp=2, tp=2, pp=2, zero=1),
                [dict(zero=0), dict(gpus_per_node=2), dict(tp=1, dp=4), dict(pp=1, tp=4),
                 dict(grad_accum_steps=4)],
                ("by", ["op", "group"])),
}


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1e3


def bench(name: str, quick: bool) -> dict[str, list[float]]:
    cls, initial, visits, view = CASES[name]
    if quick:
        visits = visits[:1]
    times: dict[str, list[float]] = {"first draw": [], "new setting": [], "revisited": [],
                                     "view change": []}
    explorer = None

    def build():
        nonlocal explorer
        explorer = cls(**initial)

    times["first draw"].append(timed(build))
    seen = [explorer.values()]
    for changes in visits:
        times["new setting"].append(timed(lambda c=changes: explorer.set(**c)))
        if explorer.error:
            raise RuntimeError(f"{name}: {changes} was refused: {explorer.error}")
        seen.append(explorer.values())
    for values in seen:  # back to every setting: all cached
        times["revisited"].append(timed(lambda v=values: explorer.set(**v)))
    if view is not None:
        control, options = view
        for option in options:
            explorer.set(**seen[0])
            times["view change"].append(timed(
                lambda o=option: setattr(explorer.controls[control], "value", o)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one setting per explorer")
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {platform.python_version()}, {os.cpu_count()} CPUs, load average {load:.2f}")
    print("| explorer | first draw | new setting (median / max) | revisited (median / max) "
          "| view change (median / max) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in CASES:
        times = bench(name, args.quick)

        def cell(values):
            if not values:
                return "-"
            return f"{statistics.median(values):.0f} / {max(values):.0f}"

        print(f"| {name} | {times['first draw'][0]:.0f} | {cell(times['new setting'])} | "
              f"{cell(times['revisited'])} | {cell(times['view change'])} |")
    print("(milliseconds of wall time per control change, on the default explorer models)")


if __name__ == "__main__":
    main()
