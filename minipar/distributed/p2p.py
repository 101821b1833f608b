"""Point-to-point messages: send / recv and their non-blocking forms isend / irecv.

As in NCCL, a send completes only when the matching receive is posted: a blocking send is
a rendezvous. So two ranks that both `send` to each other first deadlock (and are told
so); post one side with `isend` (or order them by rank) to exchange. Messages between a
pair of ranks match in posting order, per tag.

Time: a transfer starts when both sides have posted and takes alpha + S/B over the link
between the two ranks. The receiver's data is there no earlier than that. An isend does
not advance the sender's clock; its `wait()` does, to the end of the transfer.
"""

from __future__ import annotations

import numpy as np

from .comm_log import CommRecord
from .context import current
from .groups import ProcessGroup
from .memory import check_category


class Work:
    """Handle of a posted isend / irecv. `wait()` blocks until the peer posted the other
    side, books the bytes and the time, and returns the received array (None for a send)."""

    def __init__(self, cluster, device, transfer, side: str, kind: str,
                 category: str | None = None) -> None:
        self._cluster, self._device = cluster, device
        self._transfer, self._side, self._kind = transfer, side, kind
        # Both sides number the messages of a channel alike: the n-th send matches the n-th recv.
        self._message = device.next_message((transfer.src, transfer.dst, transfer.tag))
        self._finished = False
        # irecv(category=...): book the received array in the ledger when it arrives.
        self._category = None if category is None else check_category(category)
        device._pending_works[id(self)] = self

    def is_completed(self) -> bool:
        return self._finished

    def wait(self):
        transfer, device = self._transfer, self._device
        if not self._finished:
            self._cluster.wait_transfer(device.rank, transfer, self._side)
            self._finished = True
            del device._pending_works[id(self)]
            nbytes = transfer.array.nbytes
            peer = transfer.dst if self._side == "send" else transfer.src
            arrow = "->" if self._side == "send" else "<-"
            device.clock.communicate(transfer.start, transfer.end, f"{self._side} {arrow}{peer}")
            device.comm.record(
                CommRecord(
                    op=self._side,
                    group_kind=self._kind,
                    group_ranks=(transfer.src, transfer.dst),
                    sent_bytes=nbytes if self._side == "send" else 0,
                    recv_bytes=nbytes if self._side == "recv" else 0,
                    sent_to=((peer, nbytes),) if self._side == "send" else (),
                    phase=device.phase,
                    start=transfer.start,
                    end=transfer.end,
                    message=self._message,
                )
            )
            if self._category is not None:
                device.memory.hold(transfer.array, self._category)
        return transfer.array if self._side == "recv" else None


def _setup(api: str, peer: int, group: ProcessGroup | None):
    cluster, device = current(f"{api}()")
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < device.world_size:
        raise ValueError(
            f"{api}: peer rank {peer!r} is outside the world of {device.world_size} ranks"
        )
    if peer == device.rank:
        raise ValueError(f"{api}: rank {device.rank} cannot {api} to/from itself")
    kind = "other"
    if group is not None:
        if device.rank not in group or peer not in group:
            raise ValueError(f"{api}: ranks {device.rank} and {peer} must both be in {group}")
        kind = group.kind  # the group only says who pays: peers are global ranks
    return cluster, device, int(peer), kind


def isend(x, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    """Post x (copied now, so later changes to x are not sent) to global rank dst."""
    cluster, device, dst, kind = _setup("isend", dst, group)
    message = np.array(x, copy=True)
    transfer = cluster.post("send", device.rank, dst, tag, message, device.clock.now)
    return Work(cluster, device, transfer, "send", kind)


def irecv(src: int, group: ProcessGroup | None = None, tag: int = 0,
          category: str | None = None) -> Work:
    """Post a receive from global rank src; `wait()` returns the array (booked in the
    rank's memory ledger under `category` if given; the caller releases it)."""
    cluster, device, src, kind = _setup("irecv", src, group)
    transfer = cluster.post("recv", src, device.rank, tag, None, device.clock.now)
    return Work(cluster, device, transfer, "recv", kind, category)


def send(x, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send x to dst; returns once dst has received it."""
    isend(x, dst, group, tag).wait()


def recv(src: int, group: ProcessGroup | None = None, tag: int = 0,
         category: str | None = None) -> np.ndarray:
    """Receive the next message from src (on this tag); category: as for irecv."""
    return irecv(src, group, tag, category).wait()


def finish_pending(device) -> None:
    """Wait for every isend / irecv the rank left unwaited (called when its function
    returns), so their bytes are booked and a message nobody receives is reported."""
    for work in list(device._pending_works.values()):
        work.wait()
