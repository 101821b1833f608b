"""launch(fn, world_size): run fn once per virtual rank, each in its own thread.

The emulator's `torchrun` / `mp.spawn`. Each thread gets its own rank context (for
get_rank, the collectives and the autograd device) and nothing else is shared, so
launches never leak state into each other. If any rank raises, the others are woken and
stopped at their next communication or compute call, and `launch` re-raises that
rank's exception (with `.rank` set and a note naming the rank).

The watchdog (NCCL's, with torch's TORCH_NCCL_ASYNC_ERROR_HANDLING: a collective that
does not complete within the process group's timeout aborts the job, and the flight
recorder says what each rank last did). While the ranks run, the launching thread
checks every WATCH_INTERVAL seconds that no rank has waited longer than `timeout`
seconds for a peer, and that some rank has acted (computed, communicated or returned)
within the last `timeout` seconds. Otherwise it raises LaunchTimeoutError naming every
unfinished rank, what it is doing, its last action and its Python stack
(sys._current_frames()). The timeout is, in order: the `timeout` argument, the
innermost `with launch_timeout(seconds):` (exercise checkers use a short one), the
environment variable MINIPAR_LAUNCH_TIMEOUT, DEFAULT_TIMEOUT (600 s, the default of
torch.distributed's NCCL process groups: generous for any run minipar trains).

Stopping: after a failure or a timeout, every rank is woken and stops at its next call
into minipar. A rank that does not within ABORT_GRACE seconds (stuck in its own loop, or
catching the abort and retrying) gets RankAborted raised in its thread
(PyThreadState_SetAsyncExc), up to ASYNC_ABORTS times, ASYNC_GRACE seconds apart;
CPython delivers it at the thread's next bytecode, so a thread blocked inside one long C
call (time.sleep, a huge matmul) only stops when that call returns. Such a thread is left
running as a daemon thread (it cannot keep the interpreter alive) and the error says so.
The launch does not wait for it: whatever the other ranks do, the error (a deadlock, a
rank's exception) is raised within ABORT_GRACE + ASYNC_ABORTS x ASYNC_GRACE (< 1 s) of
the failure.

Cancelling: launches started inside `with cancellation:` (a `Cancellation`, by this
thread) stop when any thread calls `cancellation.cancel()`, as after a failure, and raise
LaunchCancelled. There is no such thing in torch.distributed (a job is killed from
outside); the explorers' background worker needs it to drop a run nobody waits for
(minipar/viz/prefetch.py).

A launch inside a rank is refused: a rank is one GPU, not a cluster.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import os
import sys
import threading
import time
import traceback

from threadpoolctl import threadpool_limits

from minipar.autograd.tracking import device_phase, use_device

from .allocator import keep_freed_memory
from .clock import COMPUTE_KINDS, DeviceProfile
from .cluster import Call, Cluster
from .collector import fewer_collections
from .comm_log import PHASES
from .context import _rank_context, get_device
from .errors import DistError, LaunchCancelled, LaunchTimeoutError, RankAborted
from .p2p import finish_pending
from .turns import SpareCore

DEFAULT_TIMEOUT = 600.0  # seconds; torch.distributed's default for NCCL process groups
TIMEOUT_ENV = "MINIPAR_LAUNCH_TIMEOUT"
WATCH_INTERVAL = 0.05  # seconds between the watchdog's looks
ABORT_GRACE = 0.5  # seconds a rank gets to stop by itself after an abort
ASYNC_ABORTS = 3  # times RankAborted is raised into a rank that does not stop
# Seconds a rank gets to stop after each: a thread that runs Python takes the exception at
# its next bytecode, within a GIL switch interval (5 ms) of being scheduled; one that has
# not stopped by then catches it, or is blocked in a C call that no exception interrupts.
ASYNC_GRACE = 0.15
STACK_FRAMES = 8  # frames of each rank's stack in a timeout message

_scoped_timeout: contextvars.ContextVar = contextvars.ContextVar("minipar_launch_timeout",
                                                                 default=None)


@contextlib.contextmanager
def launch_timeout(seconds: float):
    """Launches inside the block (of this thread) time out after `seconds` unless they
    pass their own `timeout=`: `with dist.launch_timeout(10): checker(...)`."""
    token = _scoped_timeout.set(_check_timeout(seconds, "launch_timeout(seconds)"))
    try:
        yield
    finally:
        _scoped_timeout.reset(token)


class Cancellation:
    """A switch that stops launches from another thread (module docstring):

        cancellation = Cancellation()
        with cancellation:                      # in the thread that launches
            launch(fn, 8)                       # -> LaunchCancelled once cancelled
        cancellation.cancel()                   # from any thread

    Only launches started inside the `with` block, by the thread that entered it, are
    stopped; one started after `cancel()` is refused at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clusters: list[Cluster] = []  # the launches running under this switch
        self._tokens: list = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            clusters = list(self._clusters)
        for cluster in clusters:
            with cluster.lock:  # wakes every rank; each stops at its next call
                cluster.fail(_cancelled(), None)

    def __enter__(self) -> Cancellation:
        self._tokens.append(_scoped_cancellation.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _scoped_cancellation.reset(self._tokens.pop())

    @contextlib.contextmanager
    def _watching(self, cluster: Cluster):
        with self._lock:
            if self.cancelled:
                raise LaunchCancelled("the launch was not started: its Cancellation was "
                                      "cancelled already")
            self._clusters.append(cluster)
        try:
            yield
        finally:
            with self._lock:
                self._clusters.remove(cluster)


_scoped_cancellation: contextvars.ContextVar = contextvars.ContextVar(
    "minipar_launch_cancellation", default=None)


def _cancelled() -> LaunchCancelled:
    return LaunchCancelled("the launch was cancelled (Cancellation.cancel()) before its "
                           "ranks finished; its results were discarded")


def _check_timeout(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value <= 0:
        raise ValueError(f"{where} must be a number of seconds > 0 (inf: never), got "
                         f"{value!r}")
    return float(value)


def resolve_timeout(timeout: float | None = None) -> float:
    """The watchdog timeout a launch uses (module docstring: argument, scope, environment
    variable, default)."""
    if timeout is not None:
        return _check_timeout(timeout, "launch(timeout=...)")
    if _scoped_timeout.get() is not None:
        return _scoped_timeout.get()
    text = os.environ.get(TIMEOUT_ENV)
    if text is not None and text.strip():
        try:
            value = float(text)
        except ValueError:
            value = text
        return _check_timeout(value, f"the environment variable {TIMEOUT_ENV}")
    return DEFAULT_TIMEOUT


def _run_rank(cluster: Cluster, rank: int, fn, args, kwargs, results: list) -> None:
    device = cluster.devices[rank]
    _rank_context.set((cluster, device))  # this thread's context only
    try:
        cluster.turns.take(rank)  # one rank runs at a time (turns.py)
        with use_device(device):
            results[rank] = fn(*args, **kwargs)
            finish_pending(device)
    except RankAborted:
        pass  # another rank failed first; launch reports that one
    except BaseException as error:  # noqa: BLE001 - any failure must abort the launch
        with cluster.lock:
            cluster.fail(error, rank)
    finally:
        with cluster.lock:
            cluster.rank_returned(rank)
            cluster.turns.give_back(rank)  # (with the lock: it may wake a queued rank)


def launch(
    fn,
    world_size: int,
    *args,
    gpus_per_node: int = 8,
    device: DeviceProfile | None = None,
    return_devices: bool = False,
    timeout: float | None = None,
    trace: bool = False,
    **kwargs,
):
    """Run fn(*args, **kwargs) on `world_size` virtual ranks; return results by rank.

    gpus_per_node: ranks per node (rank r lives on node r // gpus_per_node).
    device: the DeviceProfile every rank simulates (default: H100 SXM, see clock.py).
    return_devices: also return every rank's Device (memory, clock, comm ledgers):
        `results, devices = launch(fn, 8, return_devices=True)`.
    timeout: seconds after which the watchdog raises LaunchTimeoutError (a rank waiting
        that long, or no rank acting for that long); default: launch_timeout(), then
        $MINIPAR_LAUNCH_TIMEOUT, then DEFAULT_TIMEOUT (600 s).
    trace: record what a profiler trace needs from the start (every op's compute span,
        the memory history; see trace.py): `write_traces(dir, devices)` writes it.
    """
    if _rank_context.get() is not None:
        raise DistError(
            f"launch() was called inside virtual rank {get_device().rank}: a rank is one "
            "GPU, it cannot start a cluster of its own. Call launch once, from the main "
            "program, and use process groups (dist.new_group, DeviceMesh) inside it")
    timeout = resolve_timeout(timeout)
    keep_freed_memory()  # the next micro-batch's arrays reuse this one's (allocator.py)
    cluster = Cluster(world_size, gpus_per_node, device)
    if trace:
        for rank_device in cluster.devices:
            rank_device.start_trace()
    results: list = [None] * world_size
    threads = [
        threading.Thread(
            target=_run_rank,
            args=(cluster, rank, fn, args, kwargs, results),
            name=f"minipar-rank-{rank}",
            daemon=True,  # a rank stuck in user code must not keep the interpreter alive
        )
        for rank in range(world_size)
    ]
    # One BLAS thread per rank. The ranks are already the parallelism: letting each of N
    # rank threads also fan every matmul out to OpenBLAS's own pool oversubscribes the
    # cores and made an 8-rank step ~80x slower on a busy 2-core machine (and a
    # 1-rank step ~25x). threadpool_limits restores the previous setting on exit.
    # And the cyclic garbage collector runs less often while the ranks run (collector.py).
    cancellation = _scoped_cancellation.get()
    with (cancellation._watching(cluster) if cancellation is not None
          else contextlib.nullcontext()), threadpool_limits(limits=1, user_api="blas"), \
            fewer_collections():
        for thread in threads:
            thread.start()
        try:
            _watch(cluster, threads, timeout)
        except BaseException as interrupt:  # e.g. KeyboardInterrupt in a notebook
            with cluster.lock:
                cluster.fail(interrupt, None)
            _stop(threads)
            raise
    if cluster.failure is not None:
        error, rank = cluster.failure, cluster.failed_rank
        if rank is not None and not isinstance(error, DistError):
            error.rank = rank
            error.add_note(f"(raised on rank {rank} of {world_size} in "
                           f"minipar.distributed.launch)")
        raise error
    return (results, cluster.devices) if return_devices else results


def _watch(cluster: Cluster, threads: list, timeout: float) -> None:
    """Wait for the ranks; on a failure stop them; on a stall raise the timeout error."""
    last_progress, last_change = -1, time.monotonic()
    spare = SpareCore()
    while True:
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            return
        if cluster.failure is not None:
            left = _stop(threads)
            if left:
                error = cluster.failure
                if isinstance(error, LaunchTimeoutError):
                    error.left_running = left
                error.add_note(f"rank(s) {', '.join(map(str, left))} did not stop after "
                               "the abort and were left running as daemon threads")
            return
        alive[0].join(WATCH_INTERVAL)
        now, progress = time.monotonic(), cluster.progress()
        if progress != last_progress:
            last_progress, last_change = progress, now
        with cluster.lock:
            cluster.turns.wake_queued()  # ranks queued behind a holder that keeps the turn
            cluster.turns.lending = spare.look()  # lend it during GEMMs on a spare core
            oldest = cluster.oldest_wait()
            waited = oldest is not None and now - oldest.since > timeout
            if cluster.failure is None and (waited or now - last_change > timeout):
                cause = (f"rank {oldest.rank} waited more than {timeout:g} s ({oldest})"
                         if waited else f"no rank computed, communicated or returned for "
                         f"{timeout:g} s")
                cluster.fail(_timeout_error(cluster, threads, timeout, cause), None)


def _timeout_error(cluster: Cluster, threads: list, timeout: float,
                   cause: str) -> LaunchTimeoutError:
    """The watchdog's report (lock held): every unfinished rank, its state, its stack."""
    frames = sys._current_frames()
    stacks, lines = {}, []
    for rank, thread in enumerate(threads):
        returned, wait, last = cluster.rank_state(rank)
        if not thread.is_alive() or returned:
            continue
        frame = frames.get(thread.ident)
        summary = traceback.extract_stack(frame) if frame is not None else []
        # Only the rank's own code: drop the thread machinery and _run_rank above fn.
        first = next((i + 1 for i, f in enumerate(summary) if f.name == "_run_rank"
                      and f.filename == __file__), 0)
        stacks[rank] = traceback.StackSummary.from_list(summary[first:])
        shown = "".join(traceback.format_list(stacks[rank][-STACK_FRAMES:])).rstrip()
        lines.append(f"rank {rank}: {_describe_rank(cluster.devices[rank], wait, last)}"
                     f"\n{shown}")
    return LaunchTimeoutError(
        f"launch timed out: {cause}. Unfinished ranks (the watchdog's timeout is "
        f"{timeout:g} s; set it with launch(timeout=...) or ${TIMEOUT_ENV}):\n"
        + "\n".join(lines), timeout, stacks)


def _describe_rank(device, wait, last) -> str:
    """What a rank is doing and last did (its flight-recorder entry), in words."""
    doing = (f"waiting {time.monotonic() - wait.since:.1f} s: {wait}" if wait is not None
             else "running (not in a collective or message)")
    if last is None:
        message = "none"
    elif isinstance(last[0], Call):
        message = f"{last[0].text}, its collective #{last[1]} on that group"
    else:
        side, src, dst, tag = last
        message = (f"send to rank {dst}" if side == "send" else f"recv from rank {src}") + \
            f" (tag {tag})"
    clock = device.clock
    computed = next((e.kind for e in reversed(clock.events) if e.kind in COMPUTE_KINDS), None)
    return (f"{doing}; last collective or message: {message}; last compute: "
            f"{computed or 'none'} (simulated t = {clock.now * 1e3:.3f} ms)")


def _stop(threads: list) -> list[int]:
    """Join the ranks after an abort; raise RankAborted into those that do not stop by
    themselves (module docstring). Returns the ranks left running."""
    for attempt in range(ASYNC_ABORTS + 1):
        deadline = time.monotonic() + (ASYNC_GRACE if attempt else ABORT_GRACE)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t for t in threads if t.is_alive()]
        if not stuck or attempt == ASYNC_ABORTS:
            break
        for thread in stuck:
            # The last resort of CPython's C API (there is no safe way to kill a thread):
            # the exception is raised at the thread's next bytecode.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(RankAborted))
    return [threads.index(t) for t in threads if t.is_alive()]


def phase(name: str):
    """Charge the running rank's communication inside the `with` block to phase `name`
    (forward | backward | optimizer | other)."""
    if name not in PHASES:
        raise ValueError(f"phase {name!r} is not one of {PHASES}")
    return device_phase(get_device(), name)


@contextlib.contextmanager
def timeline_label(label: str):
    """Attach `label` to the running rank's compute events inside the block (the pipeline
    labels each micro-batch's forward "F3" and backward "B3" for the timeline plot)."""
    clock = get_device().clock
    previous = clock.compute_label
    clock.compute_label = str(label)
    try:
        yield
    finally:
        clock.compute_label = previous
