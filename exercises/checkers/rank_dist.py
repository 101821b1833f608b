"""minipar.distributed as a rank sees it when every rank runs in a process of its own.

rank_process.py installs this module as `minipar.distributed` (and as its p2p, context
and groups submodules) before it imports the file under test, so the file's
`from minipar import distributed as dist` finds it. It has minipar's point-to-point API
and nothing else: get_rank, get_world_size, new_group, send, recv, isend, irecv and their
Work.wait(). Each call is a message to the grader, which makes the same call on the
virtual rank of the same number in its own minipar.distributed.launch (rank_processes.py):
minipar matches the messages, books their bytes and time, and finds deadlocks, exactly as
when the ranks are threads. Nothing else of minipar is here: this process shares no
memory with the other ranks, and a library collective has no cluster to run on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from . import wire


class _Link:
    """The pipes to the grader, and the rank this process plays in the current call."""

    to_grader: int = -1
    from_grader: int = -1
    reader = wire.Reader()
    rank: int = 0
    world: int = 1
    ids = itertools.count()


def connect(to_grader: int, from_grader: int) -> None:
    _Link.to_grader, _Link.from_grader = to_grader, from_grader


def receive():
    """The grader's next message: (header, arrays)."""
    return wire.read(_Link.from_grader, _Link.reader)


def reply(header: dict, arrays=()) -> None:
    wire.write(_Link.to_grader, header, arrays)


def enter(rank: int, world: int) -> None:
    """The rank and world size of the call the grader asks for next."""
    _Link.rank, _Link.world = rank, world


@dataclass(frozen=True)
class ProcessGroup:
    """ranks: global ranks in ring order (sorted); kind: dp | tp | pp | cp | ep | other."""

    ranks: tuple[int, ...]
    kind: str = "other"

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self.ranks

    def group_rank(self, rank: int) -> int:
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not a member of {self}")
        return self.ranks.index(rank)

    def __str__(self) -> str:
        return f"{self.kind} group {list(self.ranks)}"


def new_group(ranks, kind: str = "other") -> ProcessGroup:
    return ProcessGroup(tuple(sorted(int(r) for r in ranks)), kind)


def get_rank(group=None) -> int:
    return _Link.rank if group is None else group.group_rank(_Link.rank)


def get_world_size(group=None) -> int:
    return _Link.world if group is None else group.size


class Work:
    """Handle of a posted isend / irecv: `wait()` returns when the grader's minipar has
    matched it, with the received array (None for a send)."""

    def __init__(self, number: int) -> None:
        self._number, self._finished, self._array = number, False, None

    def is_completed(self) -> bool:
        return self._finished

    def wait(self):
        if not self._finished:
            reply({"op": "wait", "id": self._number})
            header, arrays = receive()
            if header.get("op") != "done" or header.get("id") != self._number:
                raise wire.WireError(f"the grader answered {header} to wait #{self._number}")
            self._finished, self._array = True, (arrays[0] if arrays else None)
        return self._array


def _post(op: str, peer, group, tag, arrays=()) -> Work:
    number = next(_Link.ids)
    where = {} if group is None else {"group": list(group.ranks), "kind": group.kind}
    reply({"op": op, "id": number, "peer": int(peer), "tag": int(tag), **where}, arrays)
    return Work(number)


def isend(x, dst: int, group=None, tag: int = 0) -> Work:
    return _post("isend", dst, group, tag, [np.array(x, copy=True)])


def irecv(src: int, group=None, tag: int = 0, category: str | None = None) -> Work:
    return _post("irecv", src, group, tag)


def send(x, dst: int, group=None, tag: int = 0) -> None:
    isend(x, dst, group, tag).wait()


def recv(src: int, group=None, tag: int = 0, category: str | None = None) -> np.ndarray:
    return irecv(src, group, tag, category).wait()
