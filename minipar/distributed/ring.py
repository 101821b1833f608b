"""Ring collectives built from send/recv: what NCCL does inside all_reduce.

The n ranks of a group form a ring; each only ever talks to its neighbours. Cut the
flat tensor into n chunks. In n-1 *reduce-scatter* steps every rank passes one chunk to
its successor, which adds it to its own copy; afterwards each rank holds one fully
reduced chunk. In n-1 *all-gather* steps the reduced chunks travel once more around the
ring. Every rank sends 2(n-1) chunks of S/n bytes: 2(n-1)/n S, nearly independent of n
(Patarasuk & Yuan 2009; Baidu's ring all-reduce, Gibiansky 2017).

Each step posts the send with `isend` before the blocking `recv`: if every rank did a
blocking `send` first, each would wait for a receive its neighbour never gets to post.

The byte ledger of these functions equals that of `all_reduce` / `all_gather` /
`reduce_scatter` (tests/distributed/test_ring.py), which is how we know those book real bytes.
Values agree up to rounding: here chunk k is summed starting at rank k, not rank 0.
"""

from __future__ import annotations

import numpy as np

from .collectives import REDUCE_OPS
from .context import current
from .p2p import isend, recv


def _ring(group):
    """(group, my position, successor rank, predecessor rank)."""
    cluster, device = current("ring collective")
    group = cluster.world if group is None else group
    i, n = group.group_rank(device.rank), group.size
    return group, i, group.ranks[(i + 1) % n], group.ranks[(i - 1) % n]


def _step(chunk_out: np.ndarray, successor: int, predecessor: int, group) -> np.ndarray:
    """Send one chunk to the successor while receiving one from the predecessor."""
    request = isend(chunk_out, successor, group=group)
    chunk_in = recv(predecessor, group=group)
    request.wait()
    return chunk_in


def all_reduce_chunks(i: int, n: int, step: int) -> tuple[int, int]:
    """(chunk position i sends, chunk it receives) at `step` of ring_all_reduce: steps
    0 .. n-2 reduce-scatter (the chunk received is added to mine), n-1 .. 2n-3 all-gather
    (it replaces mine). The picture of the ring (minipar/viz/schematics/ring.py) reads it."""
    if step < n - 1:  # reduce-scatter: afterwards chunk (i+1) is complete here
        return (i - step) % n, (i - step - 1) % n
    s = step - (n - 1)  # all-gather: pass the complete chunks around once
    return (i + 1 - s) % n, (i - s) % n


def ring_all_reduce(x: np.ndarray, op: str = "sum", group=None) -> np.ndarray:
    """all_reduce(x, op, group) by reduce-scatter + all-gather around the ring. Shape of x."""
    group, i, successor, predecessor = _ring(group)
    n = group.size
    x = np.asarray(x)
    chunks = [c.copy() for c in np.array_split(x.reshape(-1), n)]
    combine = REDUCE_OPS[op]
    for step in range(2 * (n - 1)):
        send_index, recv_index = all_reduce_chunks(i, n, step)
        incoming = _step(chunks[send_index], successor, predecessor, group)
        chunks[recv_index] = (combine(chunks[recv_index], incoming) if step < n - 1
                              else incoming)
    result = np.concatenate(chunks).reshape(x.shape)
    if op == "avg":
        result = (result / np.array(n, dtype=result.dtype)).astype(result.dtype)
    return result


def ring_all_gather(x: np.ndarray, group=None, dim: int = 0) -> np.ndarray:
    """all_gather(x, group, dim): each step passes on the piece received the step before."""
    group, i, successor, predecessor = _ring(group)
    n = group.size
    pieces: list = [None] * n
    pieces[i] = np.asarray(x)
    for s in range(n - 1):
        send_index, recv_index = (i - s) % n, (i - s - 1) % n
        pieces[recv_index] = _step(pieces[send_index], successor, predecessor, group)
    return np.concatenate(pieces, axis=dim)


def ring_reduce_scatter(x: np.ndarray, op: str = "sum", group=None, dim: int = 0) -> np.ndarray:
    """reduce_scatter(x, op, group, dim): rank i ends with reduced chunk i along dim."""
    group, i, successor, predecessor = _ring(group)
    n = group.size
    chunks = [c.copy() for c in np.split(np.asarray(x), n, axis=dim)]
    combine = REDUCE_OPS[op]
    # Shifted by one from ring_all_reduce so that position i finishes with chunk i.
    for s in range(n - 1):
        send_index, recv_index = (i - s - 1) % n, (i - s - 2) % n
        incoming = _step(chunks[send_index], successor, predecessor, group)
        chunks[recv_index] = combine(chunks[recv_index], incoming)
    result = chunks[i]
    if op == "avg":
        result = (result / np.array(n, dtype=result.dtype)).astype(result.dtype)
    return result
