"""Turns: one virtual rank runs at a time, and ranks switch where they wait.

A rank takes the turn when it starts (launch.py) and again after each wake-up, and gives
it back when it waits for a collective or a message, or returns (cluster.py's `_wait`).
Without turns only the GIL decides who runs, and it decides badly for threads that call
NumPy: every NumPy call on an array large enough releases the GIL, and with 16 runnable
ranks each release hands the GIL to another thread (two context switches) whenever a
core is free to run it. One 16-rank step of the notebook explorers' tiny model (4
micro-batches) made 30-72k switches and spent 0.3-0.75 s of kernel CPU next to 0.75-1 s
of user CPU (2-5k switches when other jobs kept both cores busy); with turns 4-11k
switches and 0.03-0.14 s of kernel CPU (benchmarks/README.md, bench_widgets, "turns").
Nothing measured depends on it: every number is determined whatever the thread timing.

One turn, not two: a second rank could run a GEMM on the other core while one runs Python
(the demo model's 8-rank step took 7-21% less wall time with two turns than with one, on
an idle machine), but the two then contend for the GIL again (3-17k switches instead of
~6k in the step above), and on busy cores, where the explorers must answer, CPU counts.
Instead the turn is *lent* for the length of one long GEMM (`lend`, through
minipar.autograd.tracking.long_call): the GEMM runs without the GIL, so the next rank
runs its Python beside it, and the lender takes the turn again after the call. Only when
a core is spare (`SpareCore`): on busy cores lending is switching for nothing. Nor more
BLAS threads per rank: with the turn, only one rank computes at a time, but OpenBLAS's
threads spin-wait for each other, and with both cores taken by other jobs the demo's
single-device step took 3.7-5.4 s with 2 BLAS threads instead of 0.4-0.55 s with one
(benchmarks/README.md, "the emulator's own cost").

A turn is a preference, not a lock: a rank runs anyway once the turn has not changed hands
for PATIENCE_S while it waited, so a rank that sleeps or loops in its own code stops nobody
(the watchdog and the deadlock checks see the others run and wait as they would without
turns). The patience counts from the last hand-over, not from when the rank began to wait:
ranks queued behind several others (8 DP ranks each computing ~35 ms before their first
collective) would otherwise run out of it one after another while every turn is used
well, and then all run at once: 18-21k context switches and 0.13-0.22 s of kernel CPU in
one such step instead of ~200 and 0.03-0.05 s (benchmarks/README.md, "turns that wait
their turn").

A rank whose wait ends while another holds the turn is not woken until the holder gives
the turn back (`wake_after`): one at a time, in the order their waits ended, each when it
can run. The launch's watchdog wakes them anyway once the turn has not changed hands for
PATIENCE_S (`wake_queued`), so a holder that computes on stops nobody.

A turn that has not changed hands for STUCK_S is stuck: its holder sleeps, loops or sits
in one long call (time.sleep, a big NumPy call), and nobody queues for it again until it
changes hands. Otherwise every wake-up of every other rank would wait PATIENCE_S first:
two ranks exchanging messages beside a rank in a 4 s time.sleep would manage 20 messages
a second, and a wait cycle they close after many would be found that much later.
STUCK_S is a few times the longest a rank of the demo's or the explorers' layouts holds
the turn between two waits (measured: medians 0.1-2.4 ms, at most ~100 ms on 2 cores at
load 6), so that waking ranks still queue behind a holder that is merely computing.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

# How long a rank waits for a turn that does not change hands before it runs anyway:
# longer than the compute of a tiny model between two collectives (~1 ms), short next to
# a delay a reader notices.
PATIENCE_S = 0.05
# How long the turn must stay with one holder before nobody waits for it (docstring).
STUCK_S = 0.25


class Turns:
    """Who runs now among the `world_size` ranks of one launch: at most one holds the turn
    (a rank that ran out of patience runs without it)."""

    def __init__(self, world_size: int) -> None:
        self._turn = threading.Lock()
        self._has_turn = [False] * world_size
        self._handovers = 0  # how many times the turn was taken: it changed hands
        self._handed_over_at = time.monotonic()  # when it last did
        self._queued: deque = deque()  # wake-ups of ranks that will run after the holder
        self._taking = 0  # ranks in take() now (a hint: += from threads, under the GIL)
        self.lending = False  # lend the turn during long NumPy calls (SpareCore says when)

    def take(self, rank: int) -> None:
        """Wait for the turn before `rank` runs its own code; run without it once the turn
        has not changed hands for PATIENCE_S (its holder sleeps or loops, or computes
        that long), and at once if it is stuck (module docstring)."""
        self._taking += 1
        try:
            self._take(rank)
        finally:
            self._taking -= 1

    def _take(self, rank: int) -> None:
        while True:
            handovers = self._handovers
            if time.monotonic() - self._handed_over_at < STUCK_S:
                taken = self._turn.acquire(timeout=PATIENCE_S)
            else:  # stuck: take it if it is free, else run without it
                taken = self._turn.acquire(blocking=False)
            if taken:
                self._handovers += 1
                self._handed_over_at = time.monotonic()
                self._has_turn[rank] = True
                return
            if self._handovers == handovers:  # nobody took it meanwhile: run anyway
                self._has_turn[rank] = False
                return

    def give_back(self, rank: int) -> None:
        """Give the turn back, if `rank` has it (it is about to wait, or has returned),
        and wake the first rank queued behind it (`wake_after`)."""
        if self._has_turn[rank]:
            self._has_turn[rank] = False
            self._turn.release()
            if self._queued:
                self._queued.popleft()()

    def wake_after(self, waker: int, wake) -> None:
        """A sleeping rank's wait is over: `waker` ended it (completed its collective,
        matched its message). Call `wake()` now, or, if `waker` holds the turn, when it
        gives the turn back: the rank could not run before anyway. Woken at once, every
        other member of a collective woke only to wait for the turn, after taking the GIL
        from the waker (and the cluster's lock) on its way: 2.3k voluntary context
        switches in a 64-rank step of bench_emulation's weak scaling, 0.9k queued, where
        each wakes once, when it can run, in the order its wait ended."""
        if self._has_turn[waker]:
            self._queued.append(wake)
        else:
            wake()

    def lend(self, rank: int) -> bool:
        """Give the turn back for the length of one long NumPy call of `rank`'s (a GEMM,
        which releases the GIL) if another rank wants it: that rank then runs its Python
        on another core meanwhile, and `rank` takes the turn again after the call. True
        if given. (Called with the cluster's lock held: it may wake a queued rank.)"""
        if self.lending and self._has_turn[rank] and (self._queued or self._taking):
            self.give_back(rank)
            return True
        return False

    def wake_queued(self) -> None:
        """Wake every queued rank if the turn has not changed hands for PATIENCE_S: its
        holder computes, sleeps or loops on, and they run anyway (`take`). The launch's
        watchdog calls this at each of its looks."""
        if self._queued and time.monotonic() - self._handed_over_at >= PATIENCE_S:
            while self._queued:
                self._queued.popleft()()


class SpareCore:
    """Is a core of this machine free for a second rank? The launch's watchdog asks at
    each look and sets `Turns.lending` from the answer.

    A lent turn lets a rank run its Python beside another's GEMM: on an idle core that is
    wall time saved, on busy ones only more switching (the demo's 8-rank step: +600-900
    context switches and +4% CPU with both cores taken by other jobs, no wall time
    gained). So the turn is lent only while the cores the other processes use (all busy
    time in /proc/stat, minus this process's own CPU time) leave at least SPARE_CORES
    for this one, measured over the last WINDOW_S. Without /proc/stat (not Linux): never.
    """

    SPARE_CORES = 1.5  # one for the turn's holder, most of another for the lender's GEMM
    WINDOW_S = 0.25

    def __init__(self) -> None:
        self._cores = os.cpu_count() or 1
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()
        self._spare = False

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall, busy CPU seconds of the machine, CPU seconds of this process)."""
        try:
            with open("/proc/stat", "rb") as stat:
                ticks = [int(t) for t in stat.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        return time.monotonic(), busy / self._ticks, time.process_time()

    def look(self) -> bool:
        """True if the other processes left SPARE_CORES free over the last WINDOW_S."""
        if self._last is None or self._cores < 2:
            return False
        if time.monotonic() - self._last[0] >= self.WINDOW_S:
            now = self._sample()
            if now is None:
                return False
            wall, busy, ours = (b - a for a, b in zip(self._last, now, strict=True))
            others = max(0.0, busy - ours) / wall  # cores the other processes kept busy
            self._spare = self._cores - others >= self.SPARE_CORES
            self._last = now
        return self._spare
