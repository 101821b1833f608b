"""Where a training step's CPU goes, per function: the benchmarks' layouts under cProfile.

    python benchmarks/emulation_profile.py 3d              # the demo's 8-rank step
    python benchmarks/emulation_profile.py single          # ... and its single device
    python benchmarks/emulation_profile.py world 64        # bench_emulation's 64-rank row
    python benchmarks/emulation_profile.py dp4 --top 30    # bench_engines' dp4 layout
    PYTHONPATH=/other/tree python benchmarks/emulation_profile.py 3d   # another tree

Every rank thread runs under its own `cProfile.Profile(time.thread_time)`, so a function
is charged the CPU its rank spent in it, not the time the rank waited for its turn or a
peer; the ranks' profiles are summed. A run of 1 step is subtracted from a run of 1 + k
steps (building the ranks, the first step's warm-up and the report cancel), and the
difference is divided by k: milliseconds per step, over all ranks. Printed: the total,
the functions with the most time of their own (with the C functions they call, as
cProfile names them), and the same grouped by file.

cProfile adds a fixed cost to every call, so functions made of many small calls (the
per-op bookkeeping) look dearer than they are next to those that spend their time in
NumPy; compare two trees on the same layout, not the shares of one. For counts that do
not move with the load, see op_instructions.py.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import importlib
import pstats
import sys
import threading
import time

from arguments import positive_int
from machine import describe

from minipar.demo import DEMO_CONFIG
from minipar.train import TrainConfig, train

LAUNCH = importlib.import_module("minipar.distributed.launch")  # (the module, not the function)


def layout(name: str, world: int | None) -> TrainConfig:
    """The config of a benchmark's layout (bench_emulation.py, bench_engines.py)."""
    demo = DEMO_CONFIG.replace(check=False)
    if name == "3d":
        return demo
    if name == "single":
        return demo.replace(dp=1, tp=1, pp=1, zero=0, grad_accum_steps=demo.grad_accum_steps
                            * demo.dp, global_batch_size=demo.global_batch_size)
    if name == "dp4":
        return demo.replace(dp=4, tp=1, pp=1, zero=0, grad_accum_steps=4, precision="fp32")
    return demo.replace(tp=1, pp=1, d_model=64, n_head=4, seq_len=32, micro_batch_size=4,
                        grad_accum_steps=1, global_batch_size=None, precision="fp32",
                        dp=world, zero=1)


class Collections:
    """CPU seconds the cyclic garbage collector took while registered (gc.callbacks), in
    whichever thread set it off; its work depends on allocations, not on the profiler."""

    def __init__(self) -> None:
        self.seconds, self._started = 0.0, {}

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started[threading.get_ident()] = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started.pop(threading.get_ident())


def profiled(config: TrainConfig, steps: int, collections: Collections | None = None
             ) -> pstats.Stats:
    """The ranks' summed profile of a run of `steps` steps; `collections` (if given)
    also times the garbage collector over the run."""
    profiles = []
    run_rank = LAUNCH._run_rank

    def each_rank(*args, **kwargs):
        profile = cProfile.Profile(time.thread_time)
        profile.enable()
        try:
            return run_rank(*args, **kwargs)
        finally:
            profile.disable()
            profiles.append(profile)

    LAUNCH._run_rank = each_rank
    if collections is not None:
        gc.callbacks.append(collections)
    try:
        train(config.replace(steps=steps, warmup_steps=0))
    finally:
        LAUNCH._run_rank = run_rank
        if collections is not None:
            gc.callbacks.remove(collections)
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        stats.add(profile)
    return stats


def per_step(config: TrainConfig, steps: int) -> dict:
    """{function: (calls, own seconds, cumulative seconds)} per step: (1 + steps) - 1; and
    under the key "garbage collector", its CPU seconds per step."""
    train(config.replace(steps=1, warmup_steps=0))  # warm up (imports, caches)
    collected_one, collected_more = Collections(), Collections()
    one = profiled(config, 1, collected_one).stats
    more = profiled(config, 1 + steps, collected_more).stats
    out = {"garbage collector": (collected_more.seconds - collected_one.seconds) / steps}
    for function, (_, calls, own, cumulative, _) in more.items():
        _, calls_1, own_1, cumulative_1, _ = one.get(function, (0, 0, 0.0, 0.0, None))
        out[function] = ((calls - calls_1) / steps, (own - own_1) / steps,
                         (cumulative - cumulative_1) / steps)
    return out


def where(function: tuple) -> str:
    filename, line, name = function
    if filename == "~":
        return name  # a C function: "<method 'astype' of 'numpy.ndarray' objects>"
    for marker in ("/minipar/", "/site-packages/", "/lib/python"):
        if marker in filename:
            filename = filename[filename.index(marker) + 1:]
            break
    return f"{filename}:{line}({name})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", choices=("3d", "single", "dp4", "world"))
    parser.add_argument("world", nargs="?", type=positive_int, default=64,
                        help="ranks of the weak-scaling layout (world only)")
    parser.add_argument("--steps", type=positive_int, default=2)
    parser.add_argument("--top", type=positive_int, default=25)
    args = parser.parse_args(argv)
    config = layout(args.layout, args.world)
    print(describe())
    rows = per_step(config, args.steps)
    collector = rows.pop("garbage collector")
    total = sum(own for _, own, _ in rows.values())
    print(f"\n{args.layout}{f' {args.world}' if args.layout == 'world' else ''} "
          f"({config.world_size} ranks): {total * 1e3:.1f} ms of rank CPU per step, profiled; "
          f"the cyclic garbage collector {collector * 1e3:.1f} ms of it (gc.callbacks)")
    print(f"{'calls':>8} {'own ms':>8} {'cum ms':>8}  function")
    for function, (calls, own, cumulative) in sorted(rows.items(), key=lambda r: -r[1][1]
                                                      )[:args.top]:
        print(f"{calls:8.0f} {own * 1e3:8.2f} {cumulative * 1e3:8.2f}  {where(function)}")
    files = collections.Counter()
    for function, (_, own, _) in rows.items():
        name = where(function)
        files[name if function[0] == "~" else name.partition(":")[0]] += own
    print(f"\n{'own ms':>8}  by file (C functions apart)")
    for name, own in files.most_common(args.top):
        print(f"{own * 1e3:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
