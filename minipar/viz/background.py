"""An explorer's answers computed in the background, the latest change winning.

    later = LatestAnswer(worker, deliver)     # deliver(key, values, start, future)
    later.ask(key, values, start, compute)    # returns at once; compute() on the worker
    later.supersede()                         # an answer shown meanwhile: drop the rest

Why: in a Jupyter kernel a control's change reaches the explorer as a message on the
kernel's thread, and the next change is read only once the callback returns. An answer
computed there (0.3-1.9 s for a new 16-rank setting on busy cores) makes a reader who
sets dp, tp and pp in a row wait for three answers, one after the other, each shown for
a moment. Computed on the worker thread instead (minipar/viz/prefetch.py), the callback
returns at once, the next change arrives while the first is computed, and supersedes it:
its run is cancelled (`minipar.distributed.Cancellation`; what it finished stays in the
cache), and only the latest setting is computed and shown. Like a search box that
answers the query typed, not each letter.

Widgets may be updated from any thread (ipykernel sends every message through its IOPub
thread); `lock` keeps one explorer's updates, from the kernel's thread and from the
worker's, in order. The lock is never held while waiting for the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future

from minipar import distributed as dist
from minipar.viz.prefetch import Worker


class LatestAnswer:
    """At most one answer in progress on the worker, and the setting wanted now."""

    def __init__(self, worker: Worker, deliver: Callable) -> None:
        self.worker = worker
        self.deliver = deliver  # deliver(key, values, start, future): on the worker thread
        self.lock = threading.RLock()
        self._wanted: tuple | None = None  # (key, values, start, compute) still to show
        self._in_flight: tuple | None = None  # (key, Cancellation) being computed

    @property
    def pending(self) -> bool:
        """An answer is wanted or in progress (for tests and benchmarks)."""
        with self.lock:
            return self._wanted is not None or self._in_flight is not None

    def ask(self, key: Hashable, values: dict, start: float, compute: Callable) -> None:
        """Compute `compute()` on the worker and deliver it, unless a later `ask` or
        `supersede` comes first (then the run in progress stops, and the latest is
        computed next)."""
        with self.lock:
            self._wanted = (key, values, start, compute)
            if self._in_flight is None:
                self._start()
            elif self._in_flight[0] != key:
                self._in_flight[1].cancel()

    def supersede(self) -> None:
        """Nothing in progress is to be delivered any more (an answer was shown now)."""
        with self.lock:
            self._wanted = None
            if self._in_flight is not None:
                self._in_flight[1].cancel()

    def _start(self) -> None:  # lock held, something wanted, nothing in flight
        key, _, _, compute = self._wanted
        cancellation = dist.Cancellation()

        def job():
            with cancellation:
                return compute()

        self._in_flight = (key, cancellation)
        try:
            self.worker.submit(job, key).add_done_callback(
                lambda future: self._arrived(key, future))
        except BaseException:
            self._in_flight = None
            cancellation.cancel()
            raise

    def _arrived(self, key: Hashable, future: Future) -> None:
        """An answer is done (on the worker thread): delivered if it is still the one
        wanted; else the one wanted now, if any, is started (this one again if its run
        was stopped by a change that a later one took back: A, B, A)."""
        with self.lock:
            self._in_flight = None
            if self._wanted is None:  # superseded by an answer shown meanwhile
                return
            if self._wanted[0] != key or isinstance(future.exception(), dist.LaunchCancelled):
                self._start()  # a later change still to answer, or this one asked again
                return
            _, values, start, _ = self._wanted
            self._wanted = None
            self.deliver(key, values, start, future)
