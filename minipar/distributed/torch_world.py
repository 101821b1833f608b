"""This process's side of a torch.distributed job: joining it, its process groups, the calls.

    world = join(rank, world_size, address, port, timeout)   # init_process_group, gloo
    world.create(groups)                  # every process, the same groups, the same order
    work, finish = COLLECTIVES["all_reduce"](x, {"op": "sum"}, group, n, index)

How NumPy arrays go through torch.distributed's calls: zero-copy through torch.from_numpy,
the collectives writing into NumPy buffers; bf16 (ml_dtypes) as its uint16 bits viewed
as torch.bfloat16; what only moves (a gather, a message) as raw bytes; a dimension other
than 0 moved to the front first (torch's *_single collectives cut dimension 0). Each
call returns gloo's Work and what to do once it completed (an average divides the sum,
as collectives._reduce does, in the array's dtype).

Each minipar group is two torch process groups with its members: the payload's and the
stamps' (torch_cluster.py's clock exchange), so that wire.py can count each one's
bytes on its own sockets (gloo connects a full mesh per group).
"""

from __future__ import annotations

import datetime

import ml_dtypes
import numpy as np
import torch
import torch.distributed as tdist

from .errors import DistError
from .groups import ProcessGroup
from .wire import WireMeter, socket_fds

# Every dtype a message may carry, by the code its header holds.
DTYPES = tuple(np.dtype(t) for t in (
    np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int32, np.int16,
    np.int8, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64,
    np.complex128))
REDUCE_OPS = {"sum": tdist.ReduceOp.SUM, "avg": tdist.ReduceOp.SUM,  # avg: sum, then / n
              "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}


def reducible(array: np.ndarray) -> torch.Tensor:
    """A contiguous array as a tensor gloo can reduce, sharing its memory."""
    if array.dtype == DTYPES[3]:  # bfloat16: torch.from_numpy does not know ml_dtypes
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def raw(array: np.ndarray) -> torch.Tensor:
    """A contiguous array's bytes as a uint8 tensor, sharing its memory."""
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


def _front(x: np.ndarray, dim: int) -> np.ndarray:
    """x with `dim` first, contiguous, in a buffer of its own (gloo may write its input)."""
    return np.array(np.moveaxis(x, dim, 0), order="C", copy=True)


def _back(x: np.ndarray, dim: int) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(x, 0, dim))


# --- the collectives: start the torch call, and what to do once it completed ---------------
def _all_reduce(x, p, g, n, index):
    out = np.array(x, order="C", copy=True)
    work = tdist.all_reduce(reducible(out), op=REDUCE_OPS[p["op"]], group=g, async_op=True)
    return work, lambda: _average(out, p["op"], n)


def _all_gather(x, p, g, n, index):
    mine = _front(x, p["dim"])
    out = np.empty((n * mine.shape[0],) + mine.shape[1:], x.dtype)
    work = tdist.all_gather_single(raw(out), raw(mine), group=g, async_op=True)
    return work, lambda: _back(out, p["dim"])


def _reduce_scatter(x, p, g, n, index):
    mine = _front(x, p["dim"])
    out = np.empty((mine.shape[0] // n,) + mine.shape[1:], x.dtype)
    work = tdist.reduce_scatter_single(reducible(out), reducible(mine),
                                       op=REDUCE_OPS[p["op"]], group=g, async_op=True)
    return work, lambda: _back(_average(out, p["op"], n), p["dim"])


def _broadcast(x, p, g, n, index):
    out = np.array(x, order="C", copy=True)
    work = tdist.broadcast(raw(out), src=p["src"], group=g, async_op=True)
    return work, lambda: out


def _reduce(x, p, g, n, index):
    out = np.array(x, order="C", copy=True)
    work = tdist.reduce(reducible(out), dst=p["dst"], op=REDUCE_OPS[p["op"]], group=g,
                        async_op=True)
    root = tdist.get_rank() == p["dst"]
    return work, lambda: _average(out, p["op"], n) if root else None


def _all_to_all(x, p, g, n, index):
    mine = _front(x, p["dim"])
    out = np.empty_like(mine)
    work = tdist.all_to_all_single(raw(out), raw(mine), group=g, async_op=True)
    return work, lambda: _back(out, p["dim"])


def _barrier(x, p, g, n, index):
    return tdist.barrier(group=g, async_op=True), lambda: None


COLLECTIVES = {"all_reduce": _all_reduce, "all_gather": _all_gather,
               "reduce_scatter": _reduce_scatter, "broadcast": _broadcast, "reduce": _reduce,
               "all_to_all": _all_to_all, "barrier": _barrier}


def _average(out: np.ndarray, op: str, n: int) -> np.ndarray:
    if op == "avg":  # as collectives._reduce divides: in the array's dtype
        np.divide(out, np.array(n, dtype=out.dtype), out=out)
    return out


# --- the torch process groups of this process ----------------------------------------
class TorchGroup:
    """The two torch process groups behind one minipar group (its members, any kind): the
    payload's and the stamps', and the sockets each opened here (wire.py counts them)."""

    __slots__ = ("payload", "stamps", "sockets", "stamp_sockets")

    def __init__(self, payload, stamps, sockets=(), stamp_sockets=()):
        self.payload, self.stamps = payload, stamps
        self.sockets, self.stamp_sockets = sockets, stamp_sockets


class TorchWorld:
    """This process's side of the job, kept from launch to launch: its rank, the torch
    process groups (created once, every process in the same order: torch's new_group
    contract; DeviceMesh asks for all of its groups when built, and a group nobody created
    is refused with the reason), the wire meter, and which of the world group's sockets
    leads to which rank (for messages)."""

    def __init__(self, rank: int, world_size: int, meter, world_sockets,
                 timeout: float) -> None:
        self.rank, self.world_size, self.meter = rank, world_size, meter
        self.timeout = datetime.timedelta(seconds=timeout)
        everyone = tuple(range(world_size))
        before = socket_fds()
        stamps = tdist.new_group(list(everyone), timeout=self.timeout)
        self.groups = {everyone: TorchGroup(tdist.group.WORLD, stamps, world_sockets,
                                            meter.adopt(socket_fds() - before))}
        # My sockets' local addresses, to everyone: a peer's socket whose far end is one
        # of them leads to me.
        local = [meter.sockets[fd].local for fd in world_sockets]
        everyone_local = [None] * world_size
        tdist.all_gather_object(everyone_local, local)
        self.peer_sockets = {}
        for fd in world_sockets:
            for peer, addresses in enumerate(everyone_local):
                if peer != rank and tuple(meter.peer_of(fd)) in map(tuple, addresses):
                    self.peer_sockets[peer] = (fd,)

    def create(self, groups) -> None:
        """Create the torch groups of `groups` (minipar ProcessGroups) not created yet.
        Every process must call this with the same groups in the same order."""
        for group in groups:
            ranks = group.ranks
            if len(ranks) < 2 or ranks in self.groups:
                continue
            before = socket_fds()
            payload = tdist.new_group(list(ranks), timeout=self.timeout)
            middle = socket_fds()
            stamps = tdist.new_group(list(ranks), timeout=self.timeout)
            after = socket_fds()
            self.groups[ranks] = (TorchGroup(payload, stamps, self.meter.adopt(middle - before),
                                             self.meter.adopt(after - middle))
                                  if self.rank in ranks else None)

    def group(self, group: ProcessGroup) -> TorchGroup:
        if group.ranks not in self.groups:
            raise DistError(
                f"{group} has no torch process group: on the torch engine every process "
                "creates every group, in the same order, before using any (torch.distributed's "
                "new_group contract). Build groups with DeviceMesh, or call dist.new_group "
                "with the same ranks on every rank, members or not")
        return self.groups[group.ranks]

    def peer_socket(self, peer: int) -> tuple:
        return self.peer_sockets.get(peer, self.groups[tuple(range(self.world_size))].sockets)

    def close(self) -> None:
        """Drop this process's references to its torch process groups (after
        destroy_process_group, which drops torch's): the last reference gone runs
        ProcessGroupGloo's destructor, which joins gloo's worker threads."""
        for torch_group in self.groups.values():
            if torch_group is not None:
                torch_group.payload = torch_group.stamps = None
        self.groups.clear()


# --- joining the job --------------------------------------------------------------------
def join(rank: int, world_size: int, address: str, port: int, timeout: float, *,
         from_environment: bool = False) -> TorchWorld:
    """init_process_group (gloo) as `rank`, and this process's TorchWorld; a rendezvous
    that fails is one DistError naming the endpoint and the fix."""
    torch.set_num_threads(1)  # the ranks are the parallelism (launch.py, threadpool_limits)
    delta = datetime.timedelta(seconds=timeout)
    before = socket_fds()
    try:
        if from_environment:
            tdist.init_process_group("gloo", init_method="env://", rank=rank,
                                     world_size=world_size, timeout=delta)
        else:
            store = tdist.TCPStore(address, port, world_size, False, delta)
            tdist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                     timeout=delta)
    except (RuntimeError, ValueError, TimeoutError, OSError) as error:
        raise rendezvous_error(error, address, port, timeout) from None
    meter = WireMeter({port})
    return TorchWorld(rank, world_size, meter, meter.adopt(socket_fds() - before), timeout)


def rendezvous_error(error: BaseException, address: str, port: int, timeout: float):
    """One line for a rendezvous that failed, naming the endpoint and the fix."""
    text = str(error)
    where = f"{address}:{port}"
    if "in use" in text or "EADDRINUSE" in text:
        return DistError(f"the rendezvous port {where} is in use (another job, or one still "
                         "exiting): choose a free one (MASTER_PORT, or torchrun's "
                         "--rdzv-endpoint HOST:PORT)")
    if "not known" in text or "getaddrinfo" in text or "resolve" in text:
        return DistError(f"the rendezvous host {address!r} is unknown: check MASTER_ADDR "
                         "(torchrun's --rdzv-endpoint HOST:PORT)")
    return DistError(f"could not join the job at the rendezvous {where} within {timeout:g} s "
                     f"({text.strip().splitlines()[-1] if text.strip() else type(error).__name__}"
                     "): is rank 0's node running there, and are MASTER_ADDR / MASTER_PORT "
                     "(torchrun's --rdzv-endpoint) and WORLD_SIZE the same on every node?")


