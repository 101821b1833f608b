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

A turn is a preference, not a lock: a rank runs anyway once the turn has not changed hands
for PATIENCE_S while it waited, so a rank that sleeps or loops in its own code stops nobody
(the watchdog and the deadlock checks see the others run and wait as they would without
turns). The patience counts from the last hand-over, not from when the rank began to wait:
ranks queued behind several others (8 DP ranks each computing ~35 ms before their first
collective) would otherwise run out of it one after another while every turn is used
well, and then all run at once: 18-21k context switches and 0.13-0.22 s of kernel CPU in
one such step instead of ~200 and 0.03-0.05 s (benchmarks/README.md, "turns that wait
their turn").

A turn that did not change hands for a whole PATIENCE_S is stuck: its holder sleeps, loops
or sits in one long NumPy call, and will not give it back soon. Until it changes hands,
nobody queues for it again: otherwise every wake-up of every other rank would wait
PATIENCE_S first, and two ranks exchanging messages beside a rank in a 4 s time.sleep
would manage 20 messages a second.
"""

from __future__ import annotations

import threading

# How long a rank waits for a turn that does not change hands before it runs anyway:
# longer than the compute of a tiny model between two collectives (~1 ms), short next to
# a delay a reader notices.
PATIENCE_S = 0.05


class Turns:
    """Who runs now among the `world_size` ranks of one launch: at most one holds the turn
    (a rank that ran out of patience runs without it)."""

    def __init__(self, world_size: int) -> None:
        self._turn = threading.Lock()
        self._has_turn = [False] * world_size
        self._handovers = 0  # how many times the turn was taken: it changed hands
        self._stuck_at = -1  # _handovers when a rank last ran out of patience

    def take(self, rank: int) -> None:
        """Wait for the turn before `rank` runs its own code; run without it once the turn
        has not changed hands for PATIENCE_S (its holder sleeps or loops, or computes
        that long), and at once while it is stuck so (module docstring)."""
        while True:
            handovers = self._handovers
            if handovers == self._stuck_at:  # stuck: take it only if it is free now
                taken = self._turn.acquire(blocking=False)
            else:
                taken = self._turn.acquire(timeout=PATIENCE_S)
            if taken:
                self._handovers += 1
                self._has_turn[rank] = True
                return
            if self._handovers == handovers:  # nobody took it meanwhile: run anyway
                self._stuck_at = handovers
                self._has_turn[rank] = False
                return

    def give_back(self, rank: int) -> None:
        """Give the turn back, if `rank` has it (it is about to wait, or has returned)."""
        if self._has_turn[rank]:
            self._has_turn[rank] = False
            self._turn.release()
