"""The explorers' background worker: the measurements a reader asks for, and in spare
time the rest of an explorer's lattice of settings.

    worker = shared_worker()
    result = worker.run_now(lambda: measure(settings))      # urgent: waits for the result
    result = worker.run_now(job, key, on_wait=say_measuring)  # ... saying so past WAIT_NOTICE_S
    future = worker.submit(job, key)                      # urgent, without waiting
    worker.prefetch(owner, [(key, job), ...])             # spare time: replaces owner's list

Why: an explorer answers a setting of its lattice from results measured beforehand
(minipar/viz/lattice.py). A setting outside it is a measured run, 0.05-2 s of CPU: on
this thread, so that the kernel reads the reader's next change meanwhile
(minipar/viz/background.py). An explorer built on a model whose lattice is not shipped
measures its lattice here in spare time, nearest settings first, so that most changes
soon find their result ready.

One worker thread per process does *all* the explorers' runs, urgent jobs first, so two
measured runs never overlap: `minipar.distributed.launch` limits BLAS to one thread for
its duration, process-wide, and two launches at once would restore each other's limit
too early. An urgent job that finds a spare one in progress cancels its run (a
`minipar.distributed.Cancellation`: the ranks stop at their next call into minipar,
within a millisecond or so) unless that spare job measures the very setting asked for.
Spare jobs run only after the process has been idle for `IDLE_SECONDS` and, in a Jupyter
kernel, never while a cell is executing (IPython's pre/post_run_cell events; a cell that
starts while a spare job runs cancels its run the same way, and waits for an urgent job
in progress, an explorer's answer computed in the background, saying so, so the cell's
own runs never overlap the worker's): "Run All" is not slowed by the explorers above.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from minipar import distributed as dist

IDLE_SECONDS = 0.3  # quiet time (no urgent job, no cell running) before spare work starts
CELL_WAIT = 30.0  # seconds a starting cell waits at most for the spare job in progress
# How long an urgent job runs before its caller is told to say it is working (`run_now`'s
# on_wait): the explorers' "measuring ..." line, for a cell's own change (a change from
# the browser says it at once: minipar/viz/explorer.py). A cheap run comes back sooner,
# and then nothing flickers; a reader notices a control that does nothing for
# ~0.1 s (Nielsen's limit for a response that feels instantaneous).
WAIT_NOTICE_S = 0.1


class Worker:
    """One daemon thread that runs urgent jobs (`run_now`) before spare ones (`prefetch`)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._urgent: deque[tuple[Callable, Future]] = deque()
        self._spare: dict[int, deque[tuple[Hashable, Callable]]] = {}  # owner -> jobs
        self._busy_until = 0.0  # monotonic time before which spare work waits
        self._cells_running = 0  # IPython cells executing now (pre/post_run_cell)
        self.working = False  # a job is running on the thread
        self._spare_running = False  # ... and it is a spare one
        self._urgent_running = False  # ... or an urgent one
        self._spare_key: Hashable = None  # ... measuring this key
        self._spare_cancellation = dist.Cancellation()  # ... whose runs this stops
        self.spare_done = 0  # spare jobs finished (for tests and benchmarks)
        self.spare_cancelled = 0  # ... of which cancelled for an urgent job or a cell
        self._thread = threading.Thread(target=self._loop, name="minipar-explorer-worker",
                                        daemon=True)
        self._thread.start()
        _watch_cells(self)

    # -------------------------------------------------------------- the callers' side
    def run_now(self, job: Callable, key: Hashable = None,
                on_wait: Callable[[], None] | None = None):
        """job() on the worker thread, ahead of every spare job; its result (or error).
        A spare job in progress has its run cancelled, unless it measures `key` (what
        this job asks for: then waiting for it is the quickest answer). `on_wait()` is
        called on the caller's thread if the result takes longer than WAIT_NOTICE_S (to
        show that something is happening: on the kernel's thread a widget's change
        reaches the browser at once, while the job goes on)."""
        if threading.current_thread() is self._thread:  # a job that needs another job
            return job()
        future = self.submit(job, key)
        if on_wait is not None:
            try:
                return future.result(timeout=WAIT_NOTICE_S)
            except FutureTimeout:
                if not future.done():  # (else the job itself raised a TimeoutError)
                    try:
                        on_wait()
                    except Exception:  # noqa: BLE001 - a status line must not lose the
                        pass  # answer it announces: the job's result is what matters
        return future.result()

    def submit(self, job: Callable, key: Hashable = None) -> Future:
        """job() on the worker thread, ahead of every spare job, without waiting for it:
        its Future (`run_now` waits on it; an explorer answering in the background adds a
        callback, which runs on the worker thread). A spare job in progress is cancelled
        as for run_now. Urgent jobs run one at a time, in the order submitted."""
        future: Future = Future()
        with self._changed:
            self._urgent.append((job, future))
            self._hold_spare()
            if self._spare_running and (key is None or key != self._spare_key):
                self._spare_cancellation.cancel()
            self._changed.notify_all()
        return future

    @property
    def cell_running(self) -> bool:
        """An IPython cell is executing now (its code expects its own changes answered)."""
        with self._changed:
            return self._cells_running > 0

    def prefetch(self, owner: object, jobs: list[tuple[Hashable, Callable]]) -> None:
        """Replace `owner`'s spare jobs by `jobs` (most wanted first): what the owner
        showed last decides what is worth preparing; older wishes are dropped. The owner
        that asked last is served first: the explorer the reader is using, not one
        higher up the notebook that still has settings to measure."""
        with self._changed:
            self._spare.pop(id(owner), None)
            self._spare[id(owner)] = deque(jobs)  # (last in the dict: `_next` reads it first)
            self._changed.notify_all()

    def cancel(self, owner: object) -> None:
        with self._changed:
            self._spare.pop(id(owner), None)

    def pending(self, owner: object | None = None) -> int:
        """Spare jobs still waiting (all owners', or one owner's)."""
        with self._changed:
            if owner is not None:
                return len(self._spare.get(id(owner), ()))
            return sum(len(jobs) for jobs in self._spare.values())

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no job is waiting or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._urgent or self.working or any(self._spare.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.05))
        return True

    # -------------------------------------------------------------- IPython cells
    def cell_started(self, *_) -> None:
        """A cell starts: no spare job starts until it ends, and the cell waits for the
        job in progress and the urgent ones queued (a spare job's run is cancelled; an
        answer computed in the background is waited for: CELL_WAIT at most), so a
        cell's own runs never overlap the worker's."""
        began = time.monotonic()
        said = False
        with self._changed:
            self._cells_running += 1
            if self._spare_running:
                self._spare_cancellation.cancel()
            while ((self._spare_running or self._urgent or self._urgent_running)
                   and time.monotonic() < began + CELL_WAIT):
                if (not said and (self._urgent or self._urgent_running)
                        and time.monotonic() - began > WAIT_NOTICE_S):
                    said = True  # (a cell that seems stuck for seconds, say why: its output)
                    print("minipar: this cell waits for an explorer's answer in progress "
                          "(their runs never overlap)", flush=True)
                self._changed.wait(0.05)

    def cell_finished(self, *_) -> None:
        with self._changed:
            self._cells_running = max(0, self._cells_running - 1)
            self._hold_spare()
            self._changed.notify_all()

    def _hold_spare(self) -> None:  # lock held
        self._busy_until = time.monotonic() + IDLE_SECONDS

    # -------------------------------------------------------------- the thread
    def _next(self):
        """(job, future or None) to run next; waits until there is one (lock held)."""
        while True:
            if self._urgent:
                return self._urgent.popleft()
            now = time.monotonic()
            idle = not self._cells_running and now >= self._busy_until
            spare = next((jobs for jobs in reversed(self._spare.values()) if jobs), None)
            if spare is not None and idle:
                self._spare_key, job = spare.popleft()
                return job, None
            # Nothing to wait for but the quiet time: sleep until it ends (a cell's end,
            # an urgent job or a wish notifies).
            wait = (None if self._cells_running or spare is None
                    else max(self._busy_until - now, 0.01))
            self._changed.wait(wait)

    def _loop(self) -> None:
        while True:
            with self._changed:
                job, future = self._next()
                self.working, self._spare_running = True, future is None
                self._urgent_running = future is not None
                if self._spare_running:
                    cancellation = self._spare_cancellation = dist.Cancellation()
            try:
                if future is None:
                    try:
                        with cancellation:
                            job()
                    except dist.LaunchCancelled:  # asked for later, it is run again
                        self.spare_cancelled += 1
                    except Exception:  # noqa: BLE001 - a refused layout; asked for, it
                        pass  # is computed again and its error shown then
                elif future.set_running_or_notify_cancel():
                    try:
                        result = job()
                    except BaseException as error:  # noqa: BLE001 - the caller's to raise
                        future.set_exception(error)
                    else:  # (apart: a done-callback that raises must not fail the job)
                        future.set_result(result)
            finally:
                with self._changed:
                    self.working = self._spare_running = self._urgent_running = False
                    self._spare_key = None
                    if future is None:
                        self.spare_done += 1
                    else:
                        self._hold_spare()
                    self._changed.notify_all()


def _watch_cells(worker: Worker) -> None:
    """In an IPython kernel, hold spare work while a cell executes."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.events.register("pre_run_cell", worker.cell_started)
        shell.events.register("post_run_cell", worker.cell_finished)
        # Made by a cell (the first explorer's): that cell's pre_run_cell has passed, its
        # post_run_cell will come. IPython sets exec_result while a cell's code runs; a
        # silent execution (a kernel's silent request, a startup file) fires neither.
        result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
        if result is not None and not getattr(getattr(result, "info", None), "silent", False):
            worker.cell_started()


_shared: Worker | None = None
_shared_lock = threading.Lock()


def shared_worker() -> Worker:
    """The process's one worker (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Worker()
        return _shared


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where a reader waits on the pictures)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
