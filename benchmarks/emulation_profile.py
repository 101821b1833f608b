"""Where a training step's CPU goes, per function: the benchmarks' layouts under cProfile.

    python benchmarks/emulation_profile.py 3d              # the demo's 8-rank step
    python benchmarks/emulation_profile.py 3d-sp           # the same with sequence parallelism
    python benchmarks/emulation_profile.py single          # ... and its single device
    python benchmarks/emulation_profile.py tp2             # its tensor parallelism alone
    python benchmarks/emulation_profile.py world 64        # bench_emulation's 64-rank row
    python benchmarks/emulation_profile.py dp4 --top 30    # bench_engines' dp4 layout
    PYTHONPATH=/other/tree python benchmarks/emulation_profile.py 3d   # another tree
    python benchmarks/emulation_profile.py tp2 --ops --against single  # per op, both
    python benchmarks/emulation_profile.py 3d --ops --against single --no-lending --rounds 3

Every rank thread runs under its own `cProfile.Profile(time.thread_time)`, so a function
is charged the CPU its rank spent in it, not the time the rank waited for its turn or a
peer; the ranks' profiles are summed. A run of 1 step is subtracted from a run of 1 + k
steps (building the ranks, the first step's warm-up and the report cancel), and the
difference is divided by k: milliseconds per step, over all ranks. Printed: the total,
the functions with the most time of their own (with the C functions they call, as
cProfile names them), and the same grouped by file.

`--ops` times what a reader of the model would name instead, without cProfile: every
op's forward (`Function.apply`) and backward (its node's `backward`), and every
collective (from the call to its result), each by the CPU its rank's thread spent in it
minus what the ops or collectives it called spent (a ReduceFromTensorParallelRegion's
forward is its Python; the all_reduce inside is the all_reduce row). The rest of the
process's CPU (the engine's walk, the optimizer, the turns, the watchdog, other threads)
is one row. Calls are entries into a timed function: an asynchronous collective counts
its call and its wait. `--against single` prints the single device on the same global
batch beside, and the difference: which op costs the parallel step what one device does
not pay; `world 64 --ops --against world` compares per rank-step with 1 rank (weak
scaling). One round of a layout moves by ~0.05 in the ratio with the load; `--rounds N`
alternates the layouts N times and prints each row's median (the total: the sum of the
medians).
Timing a call costs ~2.5 us (two `time.thread_time()` system calls; measured on the
AMD EPYC of benchmarks/README.md): ~7 ms of the demo's 8-rank step (~2,800 timed calls)
and ~2 ms of its single device's (~750), so these ratios read ~0.02 above
bench_emulation's for the same runs.

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
import math
import pstats
import statistics
import sys
import threading
import time

from arguments import positive_int
from bench_emulation import single_device
from machine import describe

from minipar.demo import DEMO_CONFIG
from minipar.distributed.turns import SpareCore
from minipar.train import TrainConfig, train

LAUNCH = importlib.import_module("minipar.distributed.launch")  # (the module, not the function)


def layout(name: str, world: int | None) -> TrainConfig:
    """The config of a benchmark's layout (bench_emulation.py, bench_engines.py)."""
    demo = DEMO_CONFIG.replace(check=False)
    if name == "3d":
        return demo
    if name == "3d-sp":  # (bench_emulation.py --sequence-parallel's)
        return demo.replace(sequence_parallel=True)
    if name == "single":
        return single_device(demo)
    if name == "tp2":  # (bench_emulation.py --split's "tp2 alone")
        return single_device(demo).replace(tp=2)
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


class OpTimes:
    """Per-op and per-collective thread CPU, exclusive of the timed calls nested inside
    (`--ops`): `seconds[(name, part)]`, `calls[(name, part)]`, part F (an op's forward),
    B (its backward) or C (a collective, blocking or waited)."""

    def __init__(self) -> None:
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._nested = threading.local()  # per thread: CPU of timed calls inside this one

    def timed(self, key: tuple, call, *args, **kwargs):
        stack = self._nested.__dict__.setdefault("stack", [])
        stack.append(0.0)
        start = time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            spent = time.thread_time() - start
            inner = stack.pop()
            self.seconds[key] += spent - inner
            self.calls[key] += 1
            if stack:
                stack[-1] += spent


def op_times(config: TrainConfig, steps: int, warm_up: bool = True) -> tuple[dict, dict]:
    """({(name, part): CPU seconds per step}, {(name, part): calls per step}); the key
    ("the rest", "") is the process CPU no timed call spent (1 + steps minus 1 step)."""
    function = importlib.import_module("minipar.autograd.function")
    engine = importlib.import_module("minipar.autograd.engine")
    collectives = importlib.import_module("minipar.distributed.collectives")
    times = OpTimes()
    apply, call = function.Function.apply.__func__, engine._Walk.call
    run, wait = collectives._Collective.run, collectives.CollectiveWork.wait

    def timed_apply(cls, *args):
        return times.timed((cls.__name__, "F"), apply, cls, *args)

    def timed_call(walk, node, grads, needs=None):
        return times.timed((node.function.__name__, "B"), call, walk, node, grads, needs)

    def timed_run(collective, *args, **kwargs):
        return times.timed((collective.api, "C"), run, collective, *args, **kwargs)

    def timed_wait(work):
        name = work._collective.api if work._collective is not None else "(one rank)"
        return times.timed((name, "C"), wait, work)

    patches = ((function.Function, "apply", classmethod(timed_apply)),
               (engine._Walk, "call", timed_call),
               (collectives._Collective, "run", timed_run),
               (collectives.CollectiveWork, "wait", timed_wait))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, patched in patches:
        setattr(owner, name, patched)
    try:
        if warm_up:
            train(config.replace(steps=1, warmup_steps=0))  # (imports, caches)
        runs = []
        for n in (1, 1 + steps):
            times.seconds.clear()
            times.calls.clear()
            cpu = time.process_time()
            train(config.replace(steps=n, warmup_steps=0))
            cpu = time.process_time() - cpu
            runs.append((cpu, dict(times.seconds), dict(times.calls)))
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    (cpu_1, seconds_1, calls_1), (cpu_k, seconds_k, calls_k) = runs
    seconds = {key: (s - seconds_1.get(key, 0.0)) / steps for key, s in seconds_k.items()}
    calls = {key: (c - calls_1.get(key, 0)) / steps for key, c in calls_k.items()}
    seconds[("the rest", "")] = (cpu_k - cpu_1) / steps - sum(seconds.values())
    return seconds, calls


def median_table(rounds: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Per key, the median over rounds of `op_times`' seconds and calls (0 where a round
    has no such key)."""
    keys = set().union(*(seconds for seconds, _ in rounds))
    return ({k: statistics.median(seconds.get(k, 0.0) for seconds, _ in rounds) for k in keys},
            {k: statistics.median(calls.get(k, 0) for _, calls in rounds) for k in keys})


def print_op_times(names: list[str], tables: list[tuple[dict, dict]], top: int) -> None:
    """The `--ops` table: per op, CPU ms per step (and calls) of each layout; with two,
    the difference, largest first."""
    keys = set().union(*(seconds for seconds, _ in tables))

    def cost(key):  # what orders the rows: the difference, or the one layout's CPU
        first = tables[0][0].get(key, 0.0)
        return first - tables[1][0].get(key, 0.0) if len(tables) == 2 else first

    part_names = {"F": "forward", "B": "backward", "C": "collective", "": ""}
    print(f"\n{'':40}" + "".join(f"{name:>22}" for name in names)
          + ("     difference" if len(tables) == 2 else ""))
    print(f"{'op / collective':40}" + f"{'CPU ms':>12} {'calls':>9}" * len(tables)
          + ("       CPU ms" if len(tables) == 2 else ""))
    rows = sorted(keys, key=lambda key: -abs(cost(key)))
    for key in rows[:top]:
        label = f"{key[0]} {part_names[key[1]]}".strip()
        line = f"{label:40}" + "".join(
            f"{seconds.get(key, 0.0) * 1e3:12.2f} {calls.get(key, 0):9.1f}"
            for seconds, calls in tables)
        print(line + (f"{cost(key) * 1e3:+13.2f}" if len(tables) == 2 else ""))
    totals = [sum(seconds.values()) for seconds, _ in tables]
    print(f"{'process CPU per step':40}" + "".join(f"{t * 1e3:12.2f} {'':9}" for t in totals)
          + (f"{(totals[0] - totals[1]) * 1e3:+13.2f}" if len(tables) == 2 else ""))
    if len(tables) == 2:
        print(f"ratio {names[0]} / {names[1]}: {totals[0] / totals[1]:.2f}")


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
    parser.add_argument("layout", choices=("3d", "3d-sp", "single", "tp2", "dp4", "world"))
    parser.add_argument("world", nargs="?", type=positive_int, default=64,
                        help="ranks of the weak-scaling layout (world only)")
    parser.add_argument("--steps", type=positive_int, default=2)
    parser.add_argument("--top", type=positive_int, default=25)
    parser.add_argument("--ops", action="store_true",
                        help="per op and collective, without cProfile (module docstring)")
    parser.add_argument("--against", choices=("single", "world"),
                        help="with --ops: the same global batch on one device beside, or "
                             "(world) the weak-scaling layout on 1 rank")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="with --ops: rounds (the layouts alternate), medians printed")
    parser.add_argument("--no-lending", action="store_true",
                        help="never lend the turn during GEMMs (bench_emulation.py's)")
    args = parser.parse_args(argv)
    if args.no_lending:
        SpareCore.SPARE_CORES = math.inf  # (as bench_emulation.py --no-lending)
    if args.against is not None and not args.ops:
        parser.error("--against needs --ops")
    if args.against == "world" and args.layout != "world":
        parser.error("--against world: only with the world layout (weak scaling, against "
                     "1 rank); the others take --against single")
    if args.against == "single" and args.layout in ("single", "world"):
        parser.error("--against single: for 3d, 3d-sp, tp2 and dp4 (the world layout takes "
                     "--against world)")
    config = layout(args.layout, args.world)
    print(describe())
    if args.ops:
        configs = {f"{args.layout}{f' {args.world}' if args.layout == 'world' else ''}":
                   config}
        if args.against == "single":
            configs["single device"] = single_device(config)
        elif args.against == "world":
            configs["world 1"] = layout("world", 1)
        rounds = {name: [] for name in configs}
        for r in range(args.rounds):  # alternating, so that the load hits every layout
            for name, each in configs.items():
                seconds, calls = op_times(each, args.steps, warm_up=r == 0)
                if name.startswith("world"):  # per rank-step, so that worlds compare
                    seconds = {k: v / each.world_size for k, v in seconds.items()}
                    calls = {k: v / each.world_size for k, v in calls.items()}
                rounds[name].append((seconds, calls))
        tables = [median_table(each) for each in rounds.values()]
        per = " per rank-step" if args.layout == "world" else " per step"
        print(f"\nthread CPU of each op and collective{per} (exclusive of nested ones), "
              f"{args.steps} steps, median of {args.rounds} round(s)")
        print_op_times(list(configs), tables, args.top)
        return 0
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
