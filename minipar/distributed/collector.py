"""Python's cyclic garbage collector while ranks run: young objects collected less often.

CPython frees an object when its last reference goes; the cyclic collector only exists
for reference cycles, and it runs whenever 700 more container objects (tuples, lists,
graph nodes, Tensors) have been allocated than freed (`gc.get_threshold()[0]`). Each run
scans the objects allocated since the last; those still alive move to an older
generation, and once they make up a quarter of the old objects, a full collection scans
every object of the process (CPython's Modules/gcmodule.c, `collect_generations`).

One device's step keeps few objects alive for long: a micro-batch's graph nodes die at
its backward, and the collector hardly runs (0 of the single-device demo step's CPU).
Virtual ranks interleave: while one rank's graph waits for its backward, the others
allocate theirs, so the nodes outlive many collections, are promoted, and trigger full
collections of everything the ranks hold (their models, ledgers and timelines). Measured
with `gc.callbacks` on a 2-core AMD EPYC: 8-9 ms of the demo's 8-rank step (~2% of its
CPU) and 20-50 ms of bench_emulation's 64-rank weak-scaling step (5-10%; more the larger
the process's heap), against ~1 and ~5 ms with the first threshold at GEN0_THRESHOLD
(benchmarks/README.md, "2026-12-06 (second pass): the garbage collector").

So a launch raises that threshold while its ranks run and puts the previous one back when
the last running launch returns (launches may overlap, from several threads). Nothing
measured changes: the autograd graph holds no reference cycles (a node releases its saved
arrays when its backward runs or its last reference goes, tests/distributed/
test_collector.py), so what the ledgers record does not depend on when the collector
runs; the cycles a run leaves (its devices, ledgers and models, ~10k objects after the
demo) are garbage only once the launch has returned. Cycles a program makes meanwhile are
collected later, after at most GEN0_THRESHOLD allocations.
"""

from __future__ import annotations

import contextlib
import gc
import threading

GEN0_THRESHOLD = 50_000

_lock = threading.Lock()
_running = 0  # launches inside `fewer_collections` now
_previous: tuple[int, ...] | None = None  # the thresholds before the first of them


@contextlib.contextmanager
def fewer_collections():
    """Inside the block, collect young objects every GEN0_THRESHOLD allocations (module
    docstring), unless the process already asked for fewer (or none: threshold 0)."""
    global _running, _previous
    with _lock:
        if _running == 0:
            current = gc.get_threshold()
            if 0 < current[0] < GEN0_THRESHOLD:
                _previous = current
                gc.set_threshold(GEN0_THRESHOLD, *current[1:])
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0 and _previous is not None:
                if gc.get_threshold()[0] == GEN0_THRESHOLD:  # (unless changed meanwhile)
                    gc.set_threshold(*_previous)
                _previous = None
