"""Collectives on NumPy arrays, functional: each returns its result, inputs are untouched.

    all_reduce(x, op="sum")       every rank gets op over the group       (same shape as x)
    all_gather(x, dim=0)          every rank gets the concatenation        (n x along dim)
    reduce_scatter(x, op, dim=0)  rank i gets chunk i of the reduction     (x / n along dim)
    broadcast(x, src)             every rank gets src's x
    reduce(x, dst, op)            dst gets the reduction, the others None
    all_to_all(x, dim=0)          rank i gets chunk i of every rank's x    (same shape as x)
    barrier()                     returns when every member has arrived

all_reduce, all_gather and reduce_scatter take `async_op=True` (as in torch.distributed):
they return a `CollectiveWork` at once and `work.wait()` returns the result, so a rank can
compute while the transfer runs (gradient buckets overlapping backward).

They also take `category=` (a memory-ledger category, e.g. "buffers"): the result is then
booked in the calling rank's ledger when the rank gets it (on return, or in `wait()`), so
a strategy does not hold it by hand. The caller releases it (`dist.release`) when done.

`group=None` means the world. Reductions run in group-rank order (x_0 + x_1 + ... in
that order), so results are bit-identical whatever order the threads arrive in.

Each call books, on the calling rank, the bytes the ring algorithm (Patarasuk & Yuan
2009) makes it send and receive, and advances its clock by the alpha-beta ring time.
all_to_all has no ring: it is n-1 pairwise exchanges (NCCL's send/recv loop), so each
rank sends the n-1 chunks meant for the others, (n-1)/n of its buffer, each straight to
its owner (`sent_to` names every peer), and receives as much.
`ring.py` runs the same ring with send/recv and books the same bytes (a test checks it).
"""

from __future__ import annotations

import functools

import numpy as np

from minipar.autograd.precision import add

from .cluster import Call
from .comm_log import CommRecord
from .context import current
from .groups import ProcessGroup
from .memory import check_category

# A sum is precision.add: np.add, bit for bit, but fast on bf16 (a TP all-reduce in bf16-mixed)
REDUCE_OPS = {"sum": add, "avg": add, "max": np.maximum, "min": np.minimum}


# --- bytes each rank moves under the ring algorithm --------------------------------------
def ring_chunk_bytes(numel: int, itemsize: int, n: int) -> list[int]:
    """Bytes of the n chunks `np.array_split` cuts a flat tensor of `numel` items into."""
    base, extra = divmod(numel, n)
    return [(base + (i < extra)) * itemsize for i in range(n)]


# Cached: a training step asks for the same few sizes at every micro-batch, and working
# the chunks out again was ~125 of the ~1350 bytecodes a rank ran per all-reduce
# (benchmarks/README.md, "cheaper collectives").
@functools.lru_cache(maxsize=4096, typed=True)
def all_reduce_bytes(numel: int, itemsize: int, n: int, i: int) -> tuple[int, int]:
    """(sent, received) bytes of ring position i in a ring all-reduce over n ranks.

    Reduce-scatter step s = 0..n-2: position i sends chunk (i-s) and receives chunk
    (i-s-1) (mod n); then it owns the reduced chunk (i+1). All-gather step s: it sends
    chunk (i+1-s) and receives (i-s). So it sends every chunk twice except chunks i+1 and
    i+2 once, and receives every chunk twice except chunks i and i+1 once:
    2(n-1)/n S each when n divides the size, 2(n-1) S summed over ranks in any case.
    """
    c = ring_chunk_bytes(numel, itemsize, n)
    total = sum(c)
    return 2 * total - c[(i + 1) % n] - c[(i + 2) % n], 2 * total - c[i] - c[(i + 1) % n]


def chain_bytes(nbytes: int, n: int, position: int) -> tuple[int, int]:
    """(sent, received) of the rank at `position` along a chain of n ranks (broadcast and
    reduce): the head only sends S, the tail only receives S, everyone else both."""
    return (nbytes if position < n - 1 else 0), (nbytes if position > 0 else 0)


# --- the common path ---------------------------------------------------------------------
class _Collective:
    """One rank's call of collective `api` on `group`: validation, rendezvous, booking."""

    def __init__(self, api: str, group: ProcessGroup | None) -> None:
        self.api = api
        self.cluster, self.device = current(f"{api}()")
        if group is None:
            group = self.cluster.world
        elif not isinstance(group, ProcessGroup):
            raise TypeError(f"{api}: group must be a ProcessGroup (new_group or a DeviceMesh)")
        if self.device.rank not in group:
            raise ValueError(
                f"rank {self.device.rank} called {api} on {group}, which it is not part of"
            )
        self.group, self.n = group, group.size
        self.index = group.group_rank(self.device.rank)  # position on the ring
        self.phase = self.device.phase  # charged to the phase the call was made in
        # ((peer, bytes), ...) when the bytes do not all go to the ring successor
        self.sent_to: tuple[tuple[int, int], ...] | None = None

    def run(self, x: np.ndarray | None, params: dict, combine, full_nbytes: int,
            sent: int, received: int, async_op: bool = False, category: str | None = None):
        """Rendezvous with the group and return this rank's result, or with async_op a
        `CollectiveWork` whose wait() returns it.

        combine(list of the members' x in group order) -> list of per-rank results;
        full_nbytes is the size S of the full tensor (for the ring time); sent/received
        are this rank's bytes; category: book the result in the rank's ledger.
        """
        shape, dtype = (None, None) if x is None else (x.shape, x.dtype)
        signature = (self.api, shape, dtype, tuple(params.items()), self.group.kind)
        duration = self.cluster.links.collective_seconds(self.api, self.group.ranks,
                                                         full_nbytes)
        call = Call(signature, self.group, x, self.device.clock.now, duration)
        number = self.device.next_call_number(self.group.ranks)
        rendezvous = self.cluster.collective(self.device.rank, self.group, number, call,
                                             combine, not async_op)
        if async_op:
            return CollectiveWork(self, rendezvous, sent, received, True, category=category)
        # A blocking call is back from the rendezvous with the results there: finish it
        # here, not through a CollectiveWork and its wait() (~90 of the ~1200 bytecodes a
        # rank ran per all-reduce; benchmarks/README.md, "cheaper collectives").
        result = self.finish(rendezvous, sent, received)
        if category is not None:
            self.device.memory.hold(result, check_category(category))
        return result

    def finish(self, rendezvous, sent: int, received: int) -> np.ndarray | None:
        """Book the completed call (bytes, clock) and return this rank's result."""
        self.book(sent, received, rendezvous.start, rendezvous.end)
        return rendezvous.results[self.index]

    def book(self, sent: int, received: int, start: float, end: float) -> None:
        """Record the call in the rank's byte ledger and advance its clock to the end."""
        device, group = self.device, self.group
        successor = group.ranks[(self.index + 1) % self.n]
        sent_to = self.sent_to if self.sent_to is not None else (
            ((successor, sent),) if sent else ())
        device.clock.communicate(start, end, f"{self.api} {group.kind}")
        device.comm.record(
            CommRecord(
                op=self.api,
                group_kind=group.kind,
                group_ranks=group.ranks,
                sent_bytes=sent,
                recv_bytes=received,
                sent_to=sent_to,
                phase=self.phase,
                start=start,
                end=end,
            )
        )


class CollectiveWork:
    """Handle of a collective started with `async_op=True` (torch.distributed's Work).

    The call is posted at once and the rank computes on; `wait()` blocks until every
    member has posted, books the bytes, and returns the result. On the simulated clock the
    transfer runs from its start (the last member's arrival, or the end of the group's
    previous collective) for the ring time; a rank that computed past its end waits for
    nothing. That is how gradient buckets overlap communication with backward.
    Do not modify the input array before wait(): the last member to post reads it.
    """

    def __init__(self, collective: _Collective | None, rendezvous, sent: int, received: int,
                 register: bool, result=None, category: str | None = None,
                 device=None) -> None:
        self._collective, self._rendezvous = collective, rendezvous
        self._sent, self._received = sent, received
        self._result = result
        self._finished = collective is None
        # The ledger that books the result in wait(), once (None: the caller books it).
        self._category = None if category is None else check_category(category)
        self._device = collective.device if collective is not None else device
        self._out = None  # all_gather(out=...): the caller's buffer the result lands in
        if register and not self._finished:
            # launch waits for works a rank forgets, so their bytes are still booked
            collective.device._pending_works[id(self)] = self

    @classmethod
    def completed(cls, result, category: str | None = None, device=None) -> CollectiveWork:
        """A work that is already done (a collective over a group of one rank); with a
        category its result is still booked at wait(), like any other work's."""
        return cls(None, None, 0, 0, register=False, result=result, category=category,
                   device=device)

    def is_completed(self) -> bool:
        return self._finished

    def wait(self):
        if not self._finished:
            c, rendezvous = self._collective, self._rendezvous
            c.cluster.wait_collective(c.device.rank, rendezvous)
            self._finished = True
            c.device._pending_works.pop(id(self), None)
            self._result = c.finish(rendezvous, self._sent, self._received)
            self._rendezvous = None
        if self._out is not None:
            out, self._out = self._out, None
            out[...] = self._result
            self._result = out
        if self._category is not None:
            category, self._category = self._category, None
            self._device.memory.hold(self._result, category)
        return self._result


def _alone(c: _Collective, x, async_op: bool, category: str | None = None):
    """The result of a collective over one rank: a copy of x (no bytes, no time)."""
    work = CollectiveWork.completed(None if x is None else x.copy(), category, c.device)
    return work if async_op else work.wait()


def _check_reduce_op(api: str, op: str, x: np.ndarray) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{api}: op={op!r} is not one of {tuple(REDUCE_OPS)}")
    if op == "avg" and x.dtype.kind in "biu":
        raise TypeError(f"{api}: op='avg' needs a floating dtype, got {x.dtype}")


def _reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """Reduce in list (= group rank) order into a fresh array of the inputs' dtype."""
    combine = REDUCE_OPS[op]
    result = combine(arrays[0], arrays[1], out=np.empty_like(arrays[0]))  # (n >= 2)
    for a in arrays[2:]:
        combine(result, a, out=result)
    if op == "avg":
        np.divide(result, np.array(len(arrays), dtype=result.dtype), out=result)
    return result


def _copies(array: np.ndarray, n: int) -> list[np.ndarray]:
    """n arrays with equal contents: every rank owns its result, as on separate GPUs."""
    return [array] + [array.copy() for _ in range(n - 1)]


def _dim(api: str, x: np.ndarray, dim: int) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{api}: dim={dim} is out of range for an array of shape {x.shape}")
    return dim % x.ndim


# --- the collectives -------------------------------------------------------------------------
def all_reduce(x, op: str = "sum", group: ProcessGroup | None = None,
               async_op: bool = False, category: str | None = None
               ) -> np.ndarray | CollectiveWork:
    """op ("sum" | "avg" | "max" | "min") over the group's x, on every rank. Shape of x.
    With async_op=True, returns a CollectiveWork; its wait() returns the result.
    category: book the result in the rank's memory ledger (see the module docstring)."""
    c = _Collective("all_reduce", group)
    x = np.asarray(x)
    _check_reduce_op("all_reduce", op, x)
    if c.n == 1:
        return _alone(c, x, async_op, category)
    sent, received = all_reduce_bytes(x.size, x.itemsize, c.n, c.index)
    return c.run(x, {"op": op}, lambda arrays: _copies(_reduce(arrays, op), c.n), x.nbytes,
                 sent, received, async_op, category)


def all_gather(x, group: ProcessGroup | None = None, dim: int = 0,
               async_op: bool = False, category: str | None = None,
               out: np.ndarray | None = None) -> np.ndarray | CollectiveWork:
    """Concatenation of the group's x along dim, in group order: shape[dim] grows n-fold.
    With async_op=True, returns a CollectiveWork; its wait() returns the result.
    category: book the result in the rank's memory ledger (see the module docstring).
    out: an array of the result's shape, allocated (and booked) by the caller before the
    call, that the result is written into and returned as (torch.distributed's
    all_gather_into_tensor): a prefetch's buffer then exists from its launch."""
    c = _Collective("all_gather", group)
    x = np.asarray(x)
    dim = _dim("all_gather", x, dim)
    if out is not None:
        if category is not None:
            raise ValueError("all_gather: give out= (booked by the caller) or category=, "
                             "not both")
        expected = x.shape[:dim] + (c.n * x.shape[dim],) + x.shape[dim + 1:]
        if out.shape != expected or out.dtype != x.dtype:
            raise ValueError(f"all_gather: out has shape {out.shape} and dtype {out.dtype}, "
                             f"the result has shape {expected} and dtype {x.dtype}")
    if c.n == 1:
        work = _alone(c, x, True, category)
    else:
        # Ring: n-1 steps, each passing on one rank's piece (x.nbytes) = (n-1)/n of the
        # output.
        piece_bytes = (c.n - 1) * x.nbytes
        work = c.run(x, {"dim": dim},
                     lambda arrays: _copies(np.concatenate(arrays, axis=dim), c.n),
                     c.n * x.nbytes, piece_bytes, piece_bytes, async_op, category)
        if not async_op:  # run() has waited and returned the result
            work = CollectiveWork.completed(work, None, c.device)
    work._out = out
    return work if async_op else work.wait()


def reduce_scatter(
    x, op: str = "sum", group: ProcessGroup | None = None, dim: int = 0,
    async_op: bool = False, category: str | None = None,
) -> np.ndarray | CollectiveWork:
    """Group rank i gets chunk i (along dim) of op over the group's x: shape[dim] / n.
    With async_op=True, returns a CollectiveWork; its wait() returns the result.
    category: book the result in the rank's memory ledger (see the module docstring)."""
    c = _Collective("reduce_scatter", group)
    x = np.asarray(x)
    _check_reduce_op("reduce_scatter", op, x)
    dim = _dim("reduce_scatter", x, dim)
    if x.shape[dim] % c.n:
        raise ValueError(
            f"reduce_scatter: dim {dim} of shape {x.shape} is not divisible by the group "
            f"size {c.n}; pad the tensor to a multiple of {c.n}"
        )
    if c.n == 1:
        return _alone(c, x, async_op, category)

    def combine(arrays):
        # Copies, so each rank's chunk owns its memory (a view would keep the whole sum).
        return [chunk.copy() for chunk in np.split(_reduce(arrays, op), c.n, axis=dim)]

    # Ring: n-1 steps, each passing on one partially reduced chunk of S/n.
    chunk_bytes = (c.n - 1) * (x.nbytes // c.n)
    return c.run(x, {"op": op, "dim": dim}, combine, x.nbytes, chunk_bytes, chunk_bytes,
                 async_op, category)


def broadcast(x, src: int, group: ProcessGroup | None = None) -> np.ndarray:
    """src's x on every rank (src is a global rank). Every rank passes an array of the
    same shape and dtype, as in torch.distributed; only src's values matter."""
    c = _Collective("broadcast", group)
    x = np.asarray(x)
    root = c.group.group_rank(src)  # raises if src is not in the group
    if c.n == 1:
        return x.copy()
    # A chain along the ring from src: src sends S, the last rank only receives S.
    sent, received = chain_bytes(x.nbytes, c.n, (c.index - root) % c.n)
    return c.run(x, {"src": src}, lambda arrays: _copies(arrays[root].copy(), c.n),
                 x.nbytes, sent, received)


def reduce(x, dst: int, op: str = "sum", group: ProcessGroup | None = None):
    """op over the group's x on global rank dst; None on the other ranks."""
    c = _Collective("reduce", group)
    x = np.asarray(x)
    _check_reduce_op("reduce", op, x)
    root = c.group.group_rank(dst)  # raises if dst is not in the group
    if c.n == 1:
        return x.copy()

    def combine(arrays):
        return [_reduce(arrays, op) if i == root else None for i in range(c.n)]

    # A chain along the ring ending at dst: it starts at dst's successor.
    sent, received = chain_bytes(x.nbytes, c.n, (c.index - root - 1) % c.n)
    return c.run(x, {"dst": dst, "op": op}, combine, x.nbytes, sent, received)


def all_to_all(x, group: ProcessGroup | None = None, dim: int = 0,
               category: str | None = None) -> np.ndarray:
    """Chunk j of x (along dim, n equal chunks) goes to group rank j; the result is the
    chunks every rank sent me, concatenated in group order along dim. Shape of x.

    torch.distributed's `all_to_all_single` with equal splits; the MoE dispatch and
    combine (GShard, Lepikhin et al. 2021, section 3.2). Every member passes the same shape:
    equal chunks, as with a capacity-bounded expert buffer. Bytes: each rank sends the n-1
    chunks that are not its own, (n-1)/n of x, one to each peer, and receives as much.
    """
    c = _Collective("all_to_all", group)
    x = np.asarray(x)
    dim = _dim("all_to_all", x, dim)
    if x.shape[dim] % c.n:
        raise ValueError(
            f"all_to_all: dim {dim} of shape {x.shape} is not divisible by the group "
            f"size {c.n}: each rank must get an equal chunk"
        )
    if c.n == 1:
        work = CollectiveWork.completed(x.copy(), category, c.device)
        return work.wait()

    def combine(arrays):
        chunks = [np.split(a, c.n, axis=dim) for a in arrays]  # chunks[src][dst]
        return [np.concatenate([chunks[src][dst] for src in range(c.n)], axis=dim)
                for dst in range(c.n)]

    chunk_bytes = x.nbytes // c.n
    c.sent_to = tuple((peer, chunk_bytes) for peer in c.group.ranks
                      if peer != c.device.rank)
    moved = (c.n - 1) * chunk_bytes
    return c.run(x, {"dim": dim}, combine, x.nbytes, moved, moved, category=category)


def barrier(group: ProcessGroup | None = None) -> None:
    """Return once every member of the group has called barrier (moves no bytes)."""
    c = _Collective("barrier", group)
    if c.n == 1:
        return
    c.run(None, {}, lambda arrays: [None] * len(arrays), 0, 0, 0)
