"""A reader changes three controls in a row: how long until the last setting's picture
is shown, and how many pictures are computed on the way?

    python benchmarks/changes_in_a_row.py              # every explorer, 0.3 s apart
    python benchmarks/changes_in_a_row.py --gap 0.1 --only traffic --repeat 3

As in a Jupyter kernel: the explorers have their worker (prefetch=True), and a change is
a message the kernel reads only once the callback of the one before has returned. Two
ways of answering, in the same process, alternately:

    in turn        (background=False, what the explorers did before background.py)
                   the callback computes the answer; a change made meanwhile waits in
                   the kernel's queue, then is answered in its turn
    background     (background=True, a browser's change in a kernel now) the callback
                   returns at once, the answer is computed on the worker and a later
                   change supersedes it (minipar/viz/background.py)

The reader's clicks come at 0, gap, 2 gap seconds (a "reader" thread posts them to a
queue; the "kernel", this thread, reads the queue in order and sets the control). Every
picture is new: the cache is fresh for each run, the answers on disk are off, and
the worker's spare work (preparing neighbours) is held, so that both ways compute the
same settings from scratch. Reported per explorer: the median over --repeat runs of the
time from the first click to the last setting's picture, of the pictures shown, and of
the settings whose measured run (the explorer's `run` method, or its `holdings`) was
started and finished on the way (a superseded run is cancelled), in both ways.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import threading
import time

from arguments import non_negative_float, positive_int

os.environ["MINIPAR_CACHE_DIR"] = "off"  # every answer measured and drawn
try:
    from minipar.viz import widgets
except ImportError as error:  # ipywidgets missing
    print(f"skipped: {error}")
    sys.exit(0)

# explorer -> (class, first setting, three changes, one control each, the method that
# measures a setting)
PATHS = {
    "sharding": (widgets.ShardingExplorer, dict(dp=2, tp=2, pp=2, zero=1),
                 [("dp", 4), ("tp", 4), ("pp", 1)], "holdings"),
    "memory": (widgets.MemoryExplorer, dict(dp=4, zero=0),
               [("dp", 8), ("tp", 2), ("zero", 1)], "run"),
    "pipeline": (widgets.PipelineExplorer, dict(schedule="1f1b", pp=4, micro_batches=8),
                 [("pp", 8), ("micro_batches", 16), ("schedule", "gpipe")], "run"),
    "traffic": (widgets.TrafficExplorer, dict(dp=2, tp=2, pp=2, zero=1),
                [("dp", 4), ("tp", 4), ("pp", 1)], "run"),
}


def one_run(name: str, background: bool, gap: float) -> dict:
    cls, initial, changes, method = PATHS[name]
    explorer = cls(prefetch=True, **initial)
    explorer.prefetch_cost = lambda values: None  # no spare work: every setting is new
    explorer.worker.cancel(explorer)
    assert explorer.worker.wait_idle(60)
    started_runs, finished_runs = [], []
    original = getattr(explorer, method)

    def counted(*args, **kwargs):
        started_runs.append(repr(kwargs or args))
        result = original(*args, **kwargs)  # (a superseded run raises LaunchCancelled)
        finished_runs.append(repr(kwargs or args))
        return result

    setattr(explorer, method, counted)
    explorer.background = background
    draws = explorer.draws
    last = {**explorer.values(), **dict(changes)}
    clicks: queue.Queue = queue.Queue()
    shown = threading.Event()  # the last setting's picture is shown (no polling: a
    show = explorer._show  # loop that wakes every few ms takes the GIL from the worker)

    def showing(key, values, answer, start):
        show(key, values, answer, start)
        if values == last:
            shown.set()

    explorer._show = showing

    def reader():
        for i, change in enumerate(changes):
            time.sleep(max(0.0, started + i * gap - time.perf_counter()))
            clicks.put(change)

    started = time.perf_counter()
    threading.Thread(target=reader, daemon=True).start()
    for _ in changes:  # the kernel: one message at a time, in order
        control, value = clicks.get()
        explorer.controls[control].value = value
    assert shown.wait(120)
    seconds = time.perf_counter() - started
    assert explorer.error is None, explorer.error
    explorer.worker.wait_idle(60)
    return {"seconds": seconds, "pictures": explorer.draws - draws,
            "started": len(set(started_runs)), "finished": len(set(finished_runs))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap", type=non_negative_float, default=0.3,
                        help="seconds between clicks")
    parser.add_argument("--only", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--repeat", type=positive_int, default=3)
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; clicks {args.gap} s "
          f"apart; medians of {args.repeat} runs each way, alternately")
    print("| explorer | path | last picture after (s): in turn | background "
          "| pictures shown | runs started | runs finished |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.only:
        results = {False: [], True: []}
        for _ in range(args.repeat):
            for background in (False, True):
                results[background].append(one_run(name, background, args.gap))

        def median(way, field, results=results):
            return statistics.median(r[field] for r in results[way])

        path = ", ".join(f"{c}={v}" for c, v in PATHS[name][2])
        print(f"| {name} | {path} | {median(False, 'seconds'):.2f} | "
              f"{median(True, 'seconds'):.2f} | {median(False, 'pictures'):.0f} -> "
              f"{median(True, 'pictures'):.0f} | {median(False, 'started'):.0f} -> "
              f"{median(True, 'started'):.0f} | {median(False, 'finished'):.0f} -> "
              f"{median(True, 'finished'):.0f} |")


if __name__ == "__main__":
    main()
