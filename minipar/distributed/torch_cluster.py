"""The cluster protocol (engine.py) on torch.distributed: a rank per process, gloo moving bytes.

Where cluster.py hands arrays between threads, TorchCluster runs in each rank's own process
and calls torch.distributed (backend gloo: CPU tensors over TCP) for every collective and
message of the rank program (torch_world.py: how arrays go through its calls):

    the clocks    every collective first all-gathers a *stamp* per member, on a twin process
                  group with the same members: the member's simulated clock when it called,
                  a fingerprint of its call (op, shape, dtype, parameters, group kind) and
                  the call's number on that group. The transfer starts at the latest arrival,
                  or when the group's previous collective ends, and lasts the alpha-beta
                  time: cluster.py's rule, computed by every member from the same stamps.
                  A message carries its sender's clock in a header and the receiver answers
                  with its own: both sides get max(send, recv) + alpha + S/B.
    mismatches    stamps whose fingerprints or numbers differ: every member then exchanges
                  the calls' text and raises CollectiveMismatchError naming each member's.
                  Ranks that wait on different groups never meet: gloo's timeout ends it.

Where the result differs from the thread engine's: gloo's ring sums in its own order, not
group-rank order (bit-identical with 2 ranks, within rounding with 3 or more), its
reduce-scatter is an all-reduce then a slice (PyTorch #118911: twice the ring's bytes on
the wire), its broadcast a binomial tree and its reduce a ring reduce-scatter then a
gather to the root (facebookincubator/gloo, gloo/{allreduce,broadcast,reduce}.cc).
`wire.py` counts the bytes each really sent.

The ledgers are booked by collectives.py and p2p.py from what this returns, as on threads.
Ranks in this file are global ranks.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as tdist

from .errors import CollectiveMismatchError, LaunchTimeoutError, PeerLostError
from .groups import ProcessGroup
from .links import Links
from .torch_world import COLLECTIVES, DTYPES, TorchWorld, raw

CLOCK_LABEL = "clock exchange (minipar)"
MAX_DIMS = 8
HEADER = 3 + MAX_DIMS  # a message's header: send time, dtype, ndim, shape


def _seconds(value: float) -> np.int64:
    return np.array([value], np.float64).view(np.int64)[0]


def _float(word) -> float:
    return float(np.array([word], np.int64).view(np.float64)[0])


def fingerprint(signature: tuple) -> int:
    """A number equal on two ranks iff their calls are (cluster.Call.signature)."""
    return int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=7).digest(),
                          "little")


# --- one launch's ranks' cluster --------------------------------------------------------
class Posted:
    """One collective of this rank, from its call to its completion (the handle
    collectives.py keeps: start, end and results, the latter indexed by group rank)."""

    __slots__ = ("call", "group", "number", "index", "torch_group", "stamps", "stamp_work",
                 "work", "result", "start", "end", "results", "done", "wall")

    def __init__(self, call, group, number, index, torch_group) -> None:
        self.call, self.group, self.number, self.index = call, group, number, index
        self.torch_group = torch_group
        self.start = self.end = None
        self.results, self.done = None, False
        self.wall = [time.perf_counter(), None]  # posted, completed (gloo's callback)


class Message:
    """One side of one message (the handle p2p.py keeps: src, dst, tag, array, start, end)."""

    __slots__ = ("src", "dst", "tag", "array", "start", "end", "works", "header", "reply",
                 "send_time", "recv_time", "received", "done", "wall")

    def __init__(self, src: int, dst: int, tag: int) -> None:
        self.src, self.dst, self.tag = src, dst, tag
        self.array = self.start = self.end = None
        self.received = self.done = False
        self.wall = [time.perf_counter(), None]


class TorchCluster:
    """The cluster of one launch, as one rank's process sees it (engine.py's protocol)."""

    def __init__(self, world: TorchWorld, gpus_per_node: int, profile, timeout: float) -> None:
        self.torch, self.world_size = world, world.world_size
        self.gpus_per_node, self.profile, self.timeout = gpus_per_node, profile, timeout
        self.world = ProcessGroup(tuple(range(world.world_size)), "other")
        self.failure = None  # a peer that fails ends this process from outside
        self.device = None  # the rank's Device (set by the launcher)
        self.links = Links(gpus_per_node, profile)  # what the clock charges a wire
        self._busy_until: dict[tuple, float] = {}
        self._unresolved: dict[tuple, deque] = {}  # collectives of a group, stamps unread
        self._receiving: dict[tuple, deque] = {}  # messages of a channel, not received yet
        self.wall_comm_s = 0.0  # time blocked in communication
        self.waiting: tuple | None = None  # (what, since): the flight recorder's entry
        self.last = "none"

    # --- what every engine answers ------------------------------------------------------
    def create_groups(self, groups) -> None:
        self.torch.create(groups())

    def check_alive(self) -> None:
        pass

    # --- collectives --------------------------------------------------------------------
    def collective(self, rank: int, group: ProcessGroup, number: int, call, combine,
                   wait: bool = True) -> Posted:
        began = time.perf_counter()
        torch_group = self.torch.group(group)
        posted = Posted(call, group, number, group.group_rank(rank), torch_group)
        op, shape, _, params, _ = call.signature
        self.last = f"{call.text}, its collective #{number} on that group"
        stamp = np.array([_seconds(call.arrival), fingerprint(call.signature), number], np.int64)
        posted.stamps = np.empty(group.size * 3, np.int64)  # (member, word), flat
        meter = self.torch.meter
        meter.start(("clock", id(posted)), CLOCK_LABEL, torch_group.stamp_sockets)
        posted.stamp_work = tdist.all_gather_single(torch.from_numpy(posted.stamps),
                                                    torch.from_numpy(stamp),
                                                    group=torch_group.stamps, async_op=True)
        if shape is not None and 0 in shape:  # nothing to move: what combine makes of it
            posted.work, posted.result = None, combine([call.array] * group.size)[posted.index]
        else:
            meter.start(posted, op, torch_group.sockets)
            posted.work, posted.result = COLLECTIVES[op](call.array, dict(params),
                                                         torch_group.payload, group.size,
                                                         posted.index)
            self._when_done(posted.work, posted, torch_group.sockets)
        self._unresolved.setdefault(group.ranks, deque()).append(posted)
        self.wall_comm_s += time.perf_counter() - began
        if wait:
            self.wait_collective(rank, posted)
        return posted

    def _when_done(self, work, handle, sockets) -> None:
        """Call _completed when gloo completes `work` (in gloo's thread), or at the wait
        if this kind of work has no future (gloo's reduce_scatter)."""
        try:
            future = work.get_future()
        except RuntimeError:
            return
        future.add_done_callback(lambda _: self._completed(handle, sockets))

    def _completed(self, handle, sockets) -> None:
        """A transfer of this rank completed: when, and its bytes on the wire."""
        if handle.wall[1] is None:
            handle.wall[1] = time.perf_counter()
            self.torch.meter.stop(handle, sockets)

    def wait_collective(self, rank: int, posted: Posted) -> None:
        if posted.done:
            return
        began = time.perf_counter()
        self._resolve(posted)
        if posted.work is not None:
            self._wait(posted.work, posted.call.text + f", its collective #{posted.number} "
                       "on that group")
            self._completed(posted, posted.torch_group.sockets)
            posted.result = posted.result()
        posted.results = [None] * posted.group.size
        posted.results[posted.index] = posted.result
        posted.done = True
        now = time.perf_counter()
        self.wall_comm_s += now - began
        self.device.communicated(posted.wall[0], posted.wall[1] or now, began)

    def _resolve(self, posted: Posted) -> None:
        """Read the stamps of the group's collectives up to `posted`, in call order: each
        one's simulated start and end (cluster.py's rule: the latest arrival, or the end of
        the group's previous collective, plus the alpha-beta time)."""
        queue = self._unresolved[posted.group.ranks]
        while posted.start is None:
            head = queue.popleft()
            self._wait(head.stamp_work, f"{head.call.text}, its collective #{head.number} "
                       "on that group")
            self.torch.meter.stop(("clock", id(head)), head.torch_group.stamp_sockets)
            stamps = head.stamps.reshape(head.group.size, 3)
            if len(set(stamps[:, 1])) > 1 or len(set(stamps[:, 2])) > 1:
                self._mismatch(head)
            arrival = max(_float(word) for word in stamps[:, 0])
            head.start = max(arrival, self._busy_until.get(head.group.ranks, 0.0))
            head.end = head.start + head.call.duration
            self._busy_until[head.group.ranks] = head.end

    def _mismatch(self, head: Posted) -> None:
        texts = [None] * head.group.size
        tdist.all_gather_object(texts, (head.call.text, int(head.number)),
                                group=head.torch_group.stamps)
        lines = "\n".join(f"  rank {r}: {text} (its collective #{k} on these ranks)"
                          for r, (text, k) in zip(head.group.ranks, texts, strict=True))
        raise CollectiveMismatchError(f"collective call #{head.number} on ranks "
                                      f"{list(head.group.ranks)} differs between ranks:\n{lines}")

    def _wait(self, work, what: str) -> None:
        """work.wait(), or one error naming the call when gloo gives up on it."""
        self.waiting = (what, time.monotonic())
        try:
            work.wait()
        except RuntimeError as error:
            lines = str(error).strip().splitlines() or ["?"]
            detail = lines[-1].split("] ", 1)[-1]  # (without gloo's source file and line)
            if "imed out" in str(error):
                raise LaunchTimeoutError(
                    f"rank {self.torch.rank} waited more than {self.timeout:g} s in {what} "
                    f"(gloo: {detail})", self.timeout, {}) from None
            raise PeerLostError(f"rank {self.torch.rank} lost a peer in {what}: a process "
                                f"of the job is gone (gloo: {detail})") from None
        finally:
            self.waiting = None

    # --- point to point -----------------------------------------------------------------
    def post(self, side: str, src: int, dst: int, tag: int, array, now: float) -> Message:
        if not 0 <= tag < 2**30:
            raise ValueError(f"tag {tag} must be in 0..2**30-1 on the torch engine")
        began = time.perf_counter()
        message = Message(src, dst, tag)
        stamps = self.torch.group(self.world).stamps
        clock_sockets = self.torch.group(self.world).stamp_sockets
        meter = self.torch.meter
        meter.start(("clock", id(message)), CLOCK_LABEL, clock_sockets)  # header, reply
        if side == "send":
            self.last = f"send to rank {dst} (tag {tag})"
            message.array = array = np.ascontiguousarray(array)
            if array.ndim > MAX_DIMS or array.dtype not in DTYPES:
                raise TypeError(f"send: the torch engine sends arrays of up to {MAX_DIMS} "
                                f"dimensions of {[d.name for d in DTYPES]}, not "
                                f"{array.ndim} dimensions of {array.dtype}")
            header = np.zeros(HEADER, np.int64)
            header[:3] = _seconds(now), DTYPES.index(array.dtype), array.ndim
            header[3:3 + array.ndim] = array.shape
            message.send_time, message.reply = now, np.empty(1, np.int64)
            message.works = [tdist.isend(torch.from_numpy(header), dst, stamps, 2 * tag),
                             tdist.irecv(torch.from_numpy(message.reply), dst, stamps,
                                         2 * tag + 1)]
            if array.nbytes:
                meter.start(message, "send", self.torch.peer_socket(dst))
                work = tdist.isend(raw(array), dst, tag=tag)
                self._when_done(work, message, self.torch.peer_socket(dst))
                message.works.append(work)
        else:
            self.last = f"recv from rank {src} (tag {tag})"
            message.recv_time, message.header = now, np.empty(HEADER, np.int64)
            message.reply = np.array([_seconds(now)], np.int64)
            message.works = [tdist.irecv(torch.from_numpy(message.header), src, stamps, 2 * tag),
                             tdist.isend(torch.from_numpy(message.reply), src, stamps,
                                         2 * tag + 1)]
            self._receiving.setdefault((src, dst, tag), deque()).append(message)
        self.wall_comm_s += time.perf_counter() - began
        return message

    def wait_transfer(self, rank: int, message: Message, side: str) -> None:
        if message.done:
            return
        began = time.perf_counter()
        what = (f"send to rank {message.dst}" if side == "send" else
                f"recv from rank {message.src}") + f" (tag {message.tag})"
        if side == "send":
            for work in message.works:
                self._wait(work, what)
            if message.array.nbytes:
                self._completed(message, self.torch.peer_socket(message.dst))
            message.recv_time = _float(message.reply[0])
        else:
            queue = self._receiving[(message.src, message.dst, message.tag)]
            while not message.received:  # earlier messages of the channel arrive first
                self._receive(queue.popleft(), what)
        self.torch.meter.stop(("clock", id(message)),
                              self.torch.group(self.world).stamp_sockets)
        alpha, bandwidth = self.links.link((message.src, message.dst) if message.src < message.dst
                                     else (message.dst, message.src))
        message.start = max(message.send_time, message.recv_time)
        message.end = message.start + alpha + message.array.nbytes / bandwidth
        message.done = True
        now = time.perf_counter()
        self.wall_comm_s += now - began
        self.device.communicated(message.wall[0], message.wall[1] or now, began)

    def _receive(self, message: Message, what: str) -> None:
        for work in message.works:
            self._wait(work, what)
        header = message.header
        dtype, ndim = DTYPES[int(header[1])], int(header[2])
        message.send_time = _float(header[0])
        message.array = np.empty(tuple(int(d) for d in header[3:3 + ndim]), dtype)
        if message.array.nbytes:  # (the receiver's own bytes, gloo's protocol, are not
            # a window of their own: they count with what this rank sends meanwhile)
            self._wait(tdist.irecv(raw(message.array), message.src, tag=message.tag), what)
        message.wall[1] = time.perf_counter()
        message.received = True

    # --- what the engine reports -------------------------------------------------------
    def status(self) -> str:
        """This rank's flight-recorder line: what it waits for, and its last call."""
        waiting = self.waiting
        doing = (f"waiting {time.monotonic() - waiting[1]:.1f} s in {waiting[0]}"
                 if waiting is not None else "running (not in a collective or message)")
        clock = self.device.clock.now * 1e3 if self.device is not None else 0.0
        return (f"{doing}; last collective or message: {self.last} "
                f"(simulated t = {clock:.3f} ms)")
