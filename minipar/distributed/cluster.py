"""The shared state of one launch: who waits for what, and the rendezvous of collectives.

All of it sits behind one lock (simple beats clever). A rank that must wait records
*what* it waits for, then sleeps on its own queue (a C-level SimpleQueue: a Condition's
wait and notify cost a dozen Python calls); whoever completes that wait clears the record
and wakes it with a token (a stale one is a spurious wake-up: the wait loops). So at any
instant a rank is running, waiting (and we know on whom), or returned, and a deadlock is
a fact we can check the moment it happens: every live rank is waiting, some rank waits on
one that has returned, or the new wait closes a cycle of waits (rank 0 waits for 1, which
waits for 0), whatever the ranks outside the cycle are doing. No polling here: a rank in
an infinite loop is the launch watchdog's (launch.py), for which the cluster keeps each
rank's last action and when each wait began.

Ranks take turns to run (turns.py): one at a time, switching where they wait.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from functools import partial

from .clock import DeviceProfile
from .device import Device
from .errors import CollectiveMismatchError, DeadlockError, RankAborted
from .groups import ProcessGroup
from .links import Links
from .turns import Turns

# The most virtual ranks one launch runs: each is a Python thread with its own stack and
# ledgers, and the operating system's thread limit ("can't start new thread") comes long
# before a real cluster's size. 1024 covers every layout the lessons use (dp x tp x pp of
# an 8 x 8 x 8 mesh is 512) and starts in about a second here. docs/refusals.md.
MAX_WORLD_SIZE = 1024


class Call:
    """One rank's side of a collective: what it asked for, its data, when it arrived.

    signature = (op, shape, dtype, ((param, value), ...), group kind); ranks whose
    signatures differ made different calls. duration: simulated seconds the transfer takes
    once it starts (the same on every member, as the signatures agree).
    """

    __slots__ = ("signature", "group", "array", "arrival", "duration")

    def __init__(self, signature: tuple, group: ProcessGroup, array, arrival: float,
                 duration: float = 0.0) -> None:
        self.signature = signature
        self.group = group
        self.array = array
        self.arrival = arrival  # the rank's simulated clock when it called
        self.duration = duration

    @property
    def text(self) -> str:
        """The call as the user wrote it, e.g. "all_reduce(shape=(4,), dtype=float32,
        op='sum') on dp group [0, 2]" (built only for error messages)."""
        op, shape, dtype, params, _ = self.signature
        described = [] if shape is None else [f"shape={shape}", f"dtype={dtype}"]
        described += [f"{k}={v!r}" for k, v in params]
        return f"{op}({', '.join(described)}) on {self.group}"


class Rendezvous:
    """The k-th collective call of every member of one group."""

    __slots__ = ("group", "number", "calls", "results", "start", "end", "done")

    def __init__(self, group: ProcessGroup, number: int) -> None:
        self.group = group
        self.number = number
        self.calls: dict[int, Call] = {}
        self.results = None  # per-rank results, in group order, set by the last arrival
        self.start = 0.0  # simulated start: the latest arrival (or the group's stream frees)
        self.end = 0.0  # simulated end: start + the call's duration
        self.done = False


class Transfer:
    """One point-to-point message, from its first posted side to its matching."""

    __slots__ = ("src", "dst", "tag", "array", "send_time", "recv_time", "start", "end")

    def __init__(self, src: int, dst: int, tag: int) -> None:
        self.src, self.dst, self.tag = src, dst, tag
        self.array = None
        self.send_time = None  # sender's clock when it posted (None: not posted yet)
        self.recv_time = None
        self.start = self.end = 0.0

    @property
    def matched(self) -> bool:
        return self.send_time is not None and self.recv_time is not None


class Wait:
    """What a blocked rank waits for: `target` (a Rendezvous or Transfer) and a description."""

    __slots__ = ("rank", "target", "side", "since")

    def __init__(self, rank: int, target, side: str = "") -> None:
        self.rank, self.target, self.side = rank, target, side
        self.since = time.monotonic()  # wall-clock start, for the watchdog

    def peers(self) -> list[int]:
        """The ranks that could end this wait."""
        if isinstance(self.target, Rendezvous):
            return [r for r in self.target.group.ranks if r not in self.target.calls]
        return [self.target.dst if self.side == "send" else self.target.src]

    def __str__(self) -> str:
        t = self.target
        if isinstance(t, Rendezvous):
            op = t.calls[self.rank].signature[0]
            missing = ", ".join(map(str, self.peers()))
            return f"rank {self.rank} waits {op} #{t.number} on {t.group} for rank(s) {missing}"
        if self.side == "send":
            return f"rank {self.rank} waits send to {t.dst} (tag {t.tag}, no matching recv)"
        return f"rank {self.rank} waits recv from {t.src} (tag {t.tag}, no matching send)"


class Cluster:
    """World size, node layout, device profile, the ranks' Devices and the sync state."""

    def __init__(
        self, world_size: int, gpus_per_node: int = 8, profile: DeviceProfile | None = None
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if world_size > MAX_WORLD_SIZE:
            raise ValueError(f"world_size {world_size} is above minipar's maximum of "
                             f"{MAX_WORLD_SIZE} virtual ranks (one thread each)")
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an int >= 1, got {gpus_per_node!r}")
        if profile is not None and not isinstance(profile, DeviceProfile):
            raise TypeError(f"device must be a minipar.distributed.DeviceProfile, got {profile!r}")
        self.world_size = world_size
        self.gpus_per_node = gpus_per_node
        self.profile = profile if profile is not None else DeviceProfile()
        self.links = Links(gpus_per_node, self.profile)  # what the clock charges a wire
        self.devices = [
            Device(r, world_size, gpus_per_node, self.profile, cluster=self)
            for r in range(world_size)
        ]
        self.world = ProcessGroup(tuple(range(world_size)), "other")
        self.failure: BaseException | None = None  # the first error; aborts every rank
        self.failed_rank: int | None = None
        self.lock = threading.Lock()
        self._wakeup = [queue.SimpleQueue() for _ in range(world_size)]
        self.turns = Turns(world_size)  # who runs now (turns.py)
        self._waiting: list[Wait | None] = [None] * world_size
        self._returned = [False] * world_size
        # The watchdog's flight recorder (launch.py): collectives and messages each rank
        # has posted, and its last one (a (Call, number) or (side, src, dst, tag)).
        self._actions = [0] * world_size
        self._last_action: list = [None] * world_size
        self._any_returned = False
        self._running = world_size  # live ranks not waiting: 0 means deadlock
        self._rendezvous: dict[tuple, Rendezvous] = {}
        self._channels: dict[tuple[int, int, int], deque[Transfer]] = {}
        # Simulated time at which each group's last collective ends. Collectives of one
        # group run one after another, as on the single NCCL stream of a communicator, so
        # an asynchronous collective (async_op=True) queues behind the previous one.
        self._group_busy_until: dict[tuple[int, ...], float] = {}

    # --- placement ---------------------------------------------------------------------------
    def create_groups(self, groups) -> None:
        """Nothing to do: a group is a value on threads (engine.py: other engines' do)."""

    # --- waiting, waking, failing (all with self.lock held) ----------------------------------
    def _wait(self, wait: Wait, done) -> None:
        """Block `wait.rank` until done() is true; raises RankAborted if the launch fails."""
        rank = wait.rank
        while not done():
            self.check_alive()
            if self._waiting[rank] is None:  # (not after a spurious wake-up)
                self._waiting[rank] = wait
                self._running -= 1
                # Only this new wait can have created a deadlock: check it now.
                if self._running == 0 or (self._any_returned and any(
                        self._returned[p] for p in wait.peers())):
                    self._report_deadlock()
                    raise RankAborted
                cycle = self._cycle_through(rank)
                if cycle is not None:
                    self._report_deadlock([self._waiting[r] for r in cycle])
                    raise RankAborted
            self.turns.give_back(rank)
            self.lock.release()  # sleep and take the turn back without it: others need it
            try:
                self._wakeup[rank].get()
                if self.failure is None:  # (woken to stop: that needs no turn)
                    self.turns.take(rank)
            finally:
                self.lock.acquire()
            self.check_alive()

    def _wake(self, target, ranks, waker: int) -> None:
        """Wake those of `ranks` whose wait was on `target`, done by `waker` (wake_after)."""
        for rank in ranks:
            wait = self._waiting[rank]
            if wait is not None and wait.target is target:
                self._waiting[rank] = None
                self._running += 1
                self.turns.wake_after(waker, partial(self._wakeup[rank].put, None))

    def fail(self, error: BaseException, rank: int | None) -> None:
        """Record the first failure and wake every rank so that it aborts."""
        if self.failure is None:
            self.failure, self.failed_rank = error, rank
        for wakeup in self._wakeup:
            wakeup.put(None)

    # --- what the watchdog reads (launch.py) ----------------------------------------------
    def progress(self) -> tuple:
        """Changes while any rank makes progress: collectives and messages posted, ranks
        returned, and the simulated clocks (every compute call advances its rank's)."""
        return (sum(self._actions), sum(self._returned),
                sum(d.clock.now for d in self.devices))

    def oldest_wait(self) -> Wait | None:
        """The wait that began first among the ranks waiting now (lock held)."""
        waits = [w for w in self._waiting if w is not None]
        return min(waits, key=lambda w: w.since) if waits else None

    def rank_state(self, rank: int) -> tuple:
        """(returned, its Wait or None, its last collective or message) (lock held)."""
        return self._returned[rank], self._waiting[rank], self._last_action[rank]

    def check_alive(self) -> None:
        if self.failure is not None:
            raise RankAborted

    def rank_returned(self, rank: int) -> None:
        """Mark `rank` as returned: it may leave the others with nobody to wait for."""
        self._returned[rank] = True
        self._any_returned = True
        self._running -= 1
        if self.failure is not None:
            return
        waits = [w for w in self._waiting if w is not None]
        if waits and (self._running == 0 or any(rank in w.peers() for w in waits)):
            self._report_deadlock()

    def _cycle_through(self, start: int) -> list[int] | None:
        """The ranks of a cycle of waits through `start` (which just began to wait), in
        order, or None. An edge r -> p means r cannot go on before p acts: p is a peer of
        r's wait (a missing member of its collective, the other side of its message). A
        rank on such a cycle waits, transitively, for itself: a deadlock among those
        ranks, whatever the others do. Before this wait there was none (it would have
        been reported), so any new cycle passes through `start`: one depth-first search,
        over waiting ranks only."""
        parent = {start: None}
        stack = [start]
        while stack:
            rank = stack.pop()
            for peer in self._waiting[rank].peers():
                if peer == start:
                    cycle = [rank]
                    while parent[cycle[-1]] is not None:
                        cycle.append(parent[cycle[-1]])
                    return cycle[::-1]
                if peer not in parent and self._waiting[peer] is not None:
                    parent[peer] = rank
                    stack.append(peer)
        return None

    def _report_deadlock(self, waits: list[Wait] | None = None) -> None:
        """Fail the launch with the wait-for graph (or the blocked collective calls) of
        every waiting rank, or of `waits` only (a cycle among some of the ranks)."""
        subset = waits is not None
        if waits is None:
            waits = [w for w in self._waiting if w is not None]
        waits = sorted(waits, key=lambda w: w.rank)  # the same text whichever waited last
        on_returned = [w for w in waits if any(self._returned[p] for p in w.peers())]
        lines = [str(w) for w in waits]
        if subset:
            others = sorted(set(range(self.world_size)) - {w.rank for w in waits})
            if others:
                lines.append(f"(a cycle among ranks {', '.join(str(w.rank) for w in waits)}; "
                             f"rank(s) {', '.join(map(str, others))} are not part of it)")
        else:
            lines += [f"rank {r} has returned" for r in range(self.world_size)
                      if self._returned[r]]
        graph = "; ".join(lines)
        if not on_returned and all(isinstance(w.target, Rendezvous) for w in waits):
            # Every rank sits in a collective but no group is complete: they called
            # collectives on different groups (or in a different order).
            calls = "\n".join(f"  rank {w.rank}: {w.target.calls[w.rank].text}" for w in waits)
            error = CollectiveMismatchError(
                "ranks are blocked in collectives that can never complete: they called "
                "different collectives or used different groups, in this order:\n"
                f"{calls}\nwait-for graph: {graph}"
            )
        else:
            error = DeadlockError(f"deadlock: {graph}")
        self.fail(error, None)

    # --- collectives ---------------------------------------------------------------------------
    def collective(self, rank: int, group: ProcessGroup, number: int, call: Call, combine,
                   wait: bool = True) -> Rendezvous:
        """Join the `number`-th collective on `group`; return its Rendezvous.

        combine(list of arrays in group order) -> list of per-rank results. The last member
        to arrive checks that all calls agree, then runs `combine` (outside the lock): the
        reduction order is the group order, whatever order the threads arrived in.
        With wait=False (an asynchronous collective) a member that is not the last returns
        at once; `wait_collective` blocks later until the results are there.
        """
        key = (group.ranks, number)
        with self.lock:
            self.check_alive()
            self._actions[rank] += 1
            self._last_action[rank] = (call, number)
            rendezvous = self._rendezvous.get(key)
            if rendezvous is None:
                rendezvous = self._rendezvous[key] = Rendezvous(group, number)
            rendezvous.calls[rank] = call
            if len(rendezvous.calls) < group.size:
                if wait:
                    self._wait(Wait(rank, rendezvous), lambda: rendezvous.done)
                return rendezvous
            del self._rendezvous[key]
            calls = [rendezvous.calls[r] for r in group.ranks]
            if any(c.signature != calls[0].signature for c in calls):
                lines = "\n".join(
                    f"  rank {r}: {c.text}" for r, c in zip(group.ranks, calls, strict=True)
                )
                self.fail(
                    CollectiveMismatchError(
                        f"collective call #{number} on ranks {list(group.ranks)} differs "
                        f"between ranks:\n{lines}"
                    ),
                    None,
                )
                raise RankAborted
            # Start when the last member is there and the group's previous collective is
            # over; collectives of one group complete in call order, so this is determined.
            rendezvous.start = max(max(c.arrival for c in calls),
                                   self._group_busy_until.get(group.ranks, 0.0))
            rendezvous.end = rendezvous.start + calls[0].duration
            self._group_busy_until[group.ranks] = rendezvous.end
        rendezvous.results = combine([c.array for c in calls])
        with self.lock:
            rendezvous.done = True
            self._wake(rendezvous, group.ranks, rank)
        return rendezvous

    def wait_collective(self, rank: int, rendezvous: Rendezvous) -> None:
        """Block until an asynchronous collective that `rank` joined has its results."""
        if rendezvous.done:  # already (always, after a blocking call): nothing to wait for
            return
        with self.lock:
            self._wait(Wait(rank, rendezvous), lambda: rendezvous.done)

    # --- point to point ---------------------------------------------------------------------
    def post(self, side: str, src: int, dst: int, tag: int, array, now: float) -> Transfer:
        """Post one side ("send" with its array, or "recv") of a message src -> dst.

        Messages of one (src, dst, tag) channel match in posting order, like MPI and NCCL.
        """
        key = (src, dst, tag)
        with self.lock:
            self.check_alive()
            poster = src if side == "send" else dst
            self._actions[poster] += 1
            self._last_action[poster] = (side, src, dst, tag)
            queue = self._channels.setdefault(key, deque())
            # The queue holds posts of one side only: a post of the other side matches.
            if queue and (queue[0].send_time is None) == (side == "send"):
                transfer = queue.popleft()
            else:
                transfer = Transfer(src, dst, tag)
                queue.append(transfer)
            if side == "send":
                transfer.array, transfer.send_time = array, now
            else:
                transfer.recv_time = now
            if transfer.matched:
                # The transfer starts when both sides are there: alpha + S / B.
                alpha, bandwidth = self.links.link((src, dst) if src < dst else (dst, src))
                transfer.start = max(transfer.send_time, transfer.recv_time)
                transfer.end = transfer.start + alpha + transfer.array.nbytes / bandwidth
                self._wake(transfer, (src, dst), poster)
            return transfer

    def wait_transfer(self, rank: int, transfer: Transfer, side: str) -> None:
        """Block until `transfer` is matched by its peer."""
        with self.lock:
            self._wait(Wait(rank, transfer, side), lambda: transfer.matched)
