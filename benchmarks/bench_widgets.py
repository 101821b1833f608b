"""How long the notebook explorers take to answer a control change.

    python benchmarks/bench_widgets.py               # ~30 s
    python benchmarks/bench_widgets.py --quick       # one setting per explorer
    python benchmarks/bench_widgets.py --prefetch    # as in a notebook: the background
                                                     # worker prepares the neighbours
    python benchmarks/bench_widgets.py --prefetch --think 2   # ... for 2 s per look
    python benchmarks/bench_widgets.py --busy 2      # with 2 other processes spinning
    python benchmarks/bench_widgets.py --second-session   # the answers a first session
                                                     # kept on disk (minipar/viz/store.py)

Each explorer (minipar.viz.widgets) is driven headless, as the tests drive it: set a
control's `.value`; the callback runs synchronously (run, draw, PNG), so the wall time of
the assignment is the latency a user sees, minus the browser's drawing of a PNG. (In a
kernel a change from the browser is answered on the worker thread instead, the kernel
free meanwhile: the same run and drawing, so the same time to the picture; what that
changes for changes in a row, benchmarks/changes_in_a_row.py measures.) Three cases per
explorer:

    new setting       a layout never seen: one measured run (training step / pipeline
                      step / building the ranks) + the figures + PNG encoding
    revisited         a setting seen before: the cached picture, nothing recomputed
    view change       same run, another view (sharding: the state kind; traffic: bars by
                      op; memory and pipeline have none): figures + PNG from a cached run

A reader changes one control at a time, so a visit that names several controls is made
as several changes, one control each (every one a setting to answer; an intermediate
setting the rules refuse is counted apart: its answer is the refusal).

--prefetch builds the explorers with prefetch=True, what they do in a Jupyter kernel
(minipar/viz/prefetch.py): after each answer the reader looks at the picture, for
--think seconds or, by default, until the worker has prepared every neighbouring
setting (at most 60 s), then makes the next change. "ready" counts the new settings
whose picture was ready when asked for; "looked" is how long the reader looked (median
/ max seconds: until ready, the time the worker took to prepare the neighbours).

Reported: median and max over the settings visited, in milliseconds of wall time (and
how many new settings were answered in under TARGET_MS, the explorers' target), and,
for new settings, of CPU time of the whole process (time.process_time: what the answer
cost, whatever else the machine was doing), with the host, so the figures in
benchmarks/README.md can be compared with a rerun; "full GCs" counts Python's full
garbage collections that ran while a new setting was answered (each ~0.1 s of it), and
"of the CPU: run" the part of a new setting's CPU spent in the explorer's measured run
(`run`, the sharding explorer's `holdings`; with prefetch, only what the answer itself
ran): the rest is its figures and PNGs.
Skips with a message when ipywidgets is not installed.

The answers the explorers keep on disk are off (MINIPAR_CACHE_DIR=off): every new
setting is measured and drawn. --second-session measures what a reader who comes back
finds (a new kernel, the same machine): a first process makes the same changes with the
store on, in a temporary directory (without --busy: it stands for an earlier session),
then this process makes them again, a fresh RunCache, the store on; "on disk" counts the
new settings answered from it.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from arguments import non_negative_float

os.environ.setdefault("MINIPAR_CACHE_DIR", "off")  # --second-session names a directory
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


TARGET_MS = 200.0  # what a new setting should take at most (issue 19): "under 0.2 s"
# Each explorer's measured run (the rest of an answer is its figures and PNGs).
RUN_METHODS = {"sharding": "holdings", "memory": "run", "pipeline": "run", "traffic": "run"}


class RunTimer:
    """CPU time (time.process_time) spent in `explorer.<method>` calls that compute,
    wrapped on the instance: a new setting's run, the rest of its CPU being the figures."""

    def __init__(self, explorer, method: str) -> None:
        self.seconds, self._depth = 0.0, 0
        original = getattr(explorer, method)

        def timed_run(*args, **kwargs):
            self._depth += 1
            started = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.process_time() - started

        setattr(explorer, method, timed_run)


class FullCollectionCounter:
    """Counts Python's full garbage collections (generation 2, any thread) and the time
    they took: one inside an answer costs it ~0.1 s (minipar/viz/prefetch.py)."""

    def __init__(self) -> None:
        self.count, self.seconds, self._started = 0, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._started


COLLECTIONS_SEEN = FullCollectionCounter()


def timed(action, cpu: list | None = None, collections: list | None = None) -> float:
    started, started_cpu = time.perf_counter(), time.process_time()
    counted = COLLECTIONS_SEEN.count
    action()
    if cpu is not None:
        cpu.append((time.process_time() - started_cpu) * 1e3)
    if collections is not None:
        collections.append(COLLECTIONS_SEEN.count - counted)
    return (time.perf_counter() - started) * 1e3


def bench(name: str, quick: bool, prefetch: bool = False,
          think: float | None = None) -> dict[str, list[float]]:
    cls, initial, visits, view = CASES[name]
    if quick:
        visits = visits[:1]
    times: dict[str, list[float]] = {"first draw": [], "new setting": [], "revisited": [],
                                     "view change": [], "cpu": [], "refused": [],
                                     "ready": [], "looked": [], "on disk": [],
                                     "full collections": [], "run cpu": []}
    explorer = None

    def build():
        nonlocal explorer
        explorer = cls(**initial, **({"prefetch": True} if prefetch else {}))

    def look():  # the reader looks at the picture before the next change
        if getattr(explorer, "worker", None) is None:  # or an explorer without prefetch
            return
        started = time.perf_counter()
        if think is None:
            explorer.worker.wait_idle(60.0)
        else:
            time.sleep(think)
        times["looked"].append(time.perf_counter() - started)

    times["first draw"].append(timed(build))
    runs = (RunTimer(explorer, RUN_METHODS[name])
            if hasattr(explorer, RUN_METHODS[name]) else None)
    seen = [explorer.values()]
    for changes in visits:
        for control, value in changes.items():  # one control per change, as a reader
            look()
            ready = (hasattr(explorer, "picture_key") and explorer.picture_key(
                {**explorer.values(), control: value}) in explorer.cache)
            cpu: list[float] = []
            store = getattr(explorer, "store", None)  # (None in trees before the store)
            hits = store.hits if store is not None else 0
            collections: list[int] = []
            run_before = runs.seconds if runs is not None else 0.0
            wall = timed(lambda c=control, v=value: explorer.set(**{c: v}), cpu, collections)
            if explorer.error:
                times["refused"].append(wall)
                continue
            times["full collections"] += collections
            if runs is not None:
                times["run cpu"].append((runs.seconds - run_before) * 1e3)
            times["new setting"].append(wall)
            times["cpu"] += cpu
            times["ready"].append(ready)
            times["on disk"].append(store is not None and store.hits > hits)
            seen.append(explorer.values())
        if explorer.error:
            raise RuntimeError(f"{name}: {changes} was refused: {explorer.error}")
    if getattr(explorer, "worker", None) is not None:
        explorer.worker.cancel(explorer)
        explorer.worker.wait_idle(60.0)
    for values in seen:  # back to every setting: all cached
        times["revisited"].append(timed(lambda v=values: explorer.set(**v)))
    if view is not None:
        control, options = view
        for option in options:
            explorer.set(**seen[0])
            look()
            times["view change"].append(timed(
                lambda o=option: setattr(explorer.controls[control], "value", o)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one setting per explorer")
    parser.add_argument("--prefetch", action="store_true",
                        help="explorers with prefetch=True, as in a Jupyter kernel")
    parser.add_argument("--think", type=non_negative_float, default=None,
                        help="with --prefetch: seconds between changes (default: until "
                             "the neighbours are ready)")
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="keep N other processes spinning on the CPU meanwhile (a "
                             "machine whose cores are busy, reproducibly)")
    parser.add_argument("--second-session", action="store_true",
                        help="first fill a temporary answer store with the same changes "
                             "(another process), then measure with it")
    args = parser.parse_args()
    if args.busy < 0:
        parser.error(f"--busy: a number of processes >= 0, got {args.busy}")
    if args.second_session:
        directory = tempfile.mkdtemp(prefix="minipar-store-")
        first = [sys.executable, __file__, "--only", *args.only] + (
            ["--quick"] if args.quick else []) + (["--prefetch"] if args.prefetch else [])
        subprocess.run(first, env={**os.environ, "MINIPAR_CACHE_DIR": directory},
                       check=True, capture_output=True)
        os.environ["MINIPAR_CACHE_DIR"] = directory  # read when an explorer is built
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    try:
        report(args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def report(args) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {platform.python_version()}, {os.cpu_count()} CPUs, load average {load:.2f}, "
          + ("prefetch, " + ("until ready" if args.think is None else f"think {args.think} s")
             if args.prefetch else "no prefetch")
          + (f", {args.busy} spinning processes" if args.busy else "")
          + (", second session (answers on disk)" if args.second_session else ""))
    print("| explorer | first draw | new setting (median / max) | under 0.2 s "
          "| CPU (median / max) | ready | refused | revisited (median / max) "
          "| view change (median / max) | on disk | full GCs | of the CPU: run |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: |")
    for name in args.only:
        times = bench(name, args.quick, args.prefetch, args.think)

        def cell(values):
            if not values:
                return "-"
            return f"{statistics.median(values):.0f} / {max(values):.0f}"

        fast = sum(wall < TARGET_MS for wall in times["new setting"])
        print(f"| {name} | {times['first draw'][0]:.0f} | {cell(times['new setting'])} | "
              f"{fast} of {len(times['new setting'])} | {cell(times['cpu'])} | "
              f"{sum(times['ready'])} of {len(times['ready'])} | "
              f"{len(times['refused'])} | {cell(times['revisited'])} | "
              f"{cell(times['view change'])} | "
              f"{sum(times['on disk'])} of {len(times['on disk'])} | "
              f"{sum(times['full collections'])} | {cell(times['run cpu'])} |"
              + (f" looked {statistics.median(times['looked']):.1f} / "
                 f"{max(times['looked']):.1f} s |" if times["looked"] else ""))
    print("(milliseconds per control change, on the default explorer models)")


if __name__ == "__main__":
    main()
