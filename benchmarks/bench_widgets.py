"""What a control change costs the kernel: the explorers driven headless along the path
benchmarks/browser_explorers.py takes in a browser.

    python benchmarks/bench_widgets.py               # the 50 changes, ~10 s
    python benchmarks/bench_widgets.py --repeat 5    # each change's median of 5 rounds

Each explorer (minipar.viz.widgets) is built with its defaults and driven as the tests
drive it: set a control's `.value`, and the callback answers synchronously. A change to
a setting of the explorer's lattice (measured beforehand, minipar/viz/lattice.py) costs
the rules, a lookup and the pictures' data (JSON, the size is reported); any other is a
measured run. Reported per change: wall and CPU milliseconds (time.process_time: what
the answer cost, whatever else the machine did), the data's size, and whether the
setting is on the lattice; then the median and maximum of the lattice changes. The
kernel's time is part of what the browser benchmark times from a control's change to
the picture painted; the rest is the messages and the browser's drawing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from arguments import positive_int
from browser_explorers import EXPLORERS, PATH

os.environ["MINIPAR_CACHE_DIR"] = "off"  # off the lattice: measured here
try:
    from minipar.viz import widgets
    from minipar.viz.lattice import key_text
except ImportError as error:  # ipywidgets or anywidget missing
    print(f"skipped: {error}")
    sys.exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="rounds of the path (each change's median is reported)")
    args = parser.parse_args()
    rounds = []
    for _ in range(args.repeat):
        made = [getattr(widgets, name)(prefetch=False) for name in EXPLORERS]
        timed = []
        for k, name, value in PATH:
            explorer = made[k]
            wall, cpu = time.perf_counter(), time.process_time()
            explorer.set(**{name: value})
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            on = key_text(explorer.measured(explorer.values())) in explorer.measurements.shipped
            timed.append((k, name, value, on, explorer.error is not None, 1000 * wall,
                          1000 * cpu, len(explorer.view.data)))
        rounds.append(timed)
    print(f"{'#':>3} {'explorer':16} {'change':34} {'lattice':>7} {'wall ms':>8} "
          f"{'CPU ms':>7} {'data KiB':>8}")
    lattice = []
    for i, first in enumerate(rounds[0]):
        k, name, value, on, refused = first[:5]
        wall = statistics.median(r[i][5] for r in rounds)
        cpu = statistics.median(r[i][6] for r in rounds)
        what = f"{name} = {value}" + (" (refused)" if refused else "")
        print(f"{i + 1:>3} {EXPLORERS[k]:16} {what:34} {'yes' if on else 'no':>7} "
              f"{wall:8.1f} {cpu:7.1f} {first[7] / 1024:8.1f}")
        if on:
            lattice.append((wall, cpu))
    walls, cpus = [w for w, _ in lattice], [c for _, c in lattice]
    print(f"\n{len(lattice)} changes to lattice settings: wall median "
          f"{statistics.median(walls):.1f} ms, max {max(walls):.1f} ms; CPU median "
          f"{statistics.median(cpus):.1f} ms, max {max(cpus):.1f} ms (load average "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
