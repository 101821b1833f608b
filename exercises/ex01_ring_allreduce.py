"""Exercise 01: ring all-reduce from send and receive.

Check your work:   python -m exercises.check 01

NCCL's all_reduce is not magic: it passes chunks around a ring of GPUs using nothing but
point-to-point sends and receives. Here you build it yourself on minipar's virtual ranks,
and the byte ledger tells you whether your ring moves what NCCL's ring moves.

Read first:
- Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations" (the ring, section 3), or Gibiansky 2017, "Bringing HPC techniques to deep
  learning" (Baidu's blog post, with pictures of every step).
- minipar/distributed/p2p.py: send / recv / isend / irecv. A blocking `send` returns only when
  the receiver has posted its `recv` (a rendezvous, as with NCCL).

Write only `ring_all_reduce` below; `ring_neighbours` is given.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist


def ring_neighbours(group=None) -> tuple[int, int, int, int]:
    """(my position i on the ring, ring size n, global rank of my successor, of my
    predecessor). The ring is the group's ranks in order; group=None means every rank.

    Example: group ranks [1, 3, 5] seen from global rank 3: (1, 3, 5, 1).
    Peers of send/recv are *global* ranks, so use these, not i + 1.
    """
    ranks = list(range(dist.get_world_size())) if group is None else list(group.ranks)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def ring_all_reduce(x: np.ndarray, group=None) -> np.ndarray:
    """The sum of `x` over the ranks of `group`, returned on every rank: what
    `dist.all_reduce(x, group=group)` returns, built from send/recv only.

    x: any shape, same shape and dtype on every rank (say S bytes). Returns a new array of
    x's shape and dtype; x itself must stay unchanged.

    The algorithm, on a ring of n ranks (position i sends to i+1, receives from i-1):
    1. Flatten x and cut it into n chunks: `np.array_split(x.reshape(-1), n)` (the last
       chunks may be one element shorter, or empty when x has fewer than n elements).
    2. Reduce-scatter, n - 1 steps. In step s, position i sends chunk (i - s) mod n to its
       successor and receives chunk (i - s - 1) mod n from its predecessor, which it adds
       to its own copy of that chunk. After n - 1 steps, position i holds chunk
       (i + 1) mod n summed over all ranks.
    3. All-gather, n - 1 steps. In step s, position i sends chunk (i + 1 - s) mod n (a
       complete one) and receives complete chunk (i - s) mod n, which replaces its copy.
    4. Concatenate the chunks and reshape to x's shape.

    What the checker measures:
    - values: equal to x_0 + x_1 + ... + x_{n-1} up to rounding, and bit-identical on every
      rank (every rank ends with the same copy of every reduced chunk);
    - bytes: every rank sends 2(n-1) chunks of S/n: 2(n-1)/n * S bytes, exactly what
      `dist.all_reduce` books (per rank, when n divides the size; in total, always), and
      only to its ring neighbour;
    - no deadlock, for n = 2, 3, 4 and on a sub-group of the world;
    - time: as fast as `dist.all_reduce` on the simulated clock (the n sends of a step
      run at the same time).

    Hints:
    - Deadlock: if every rank first calls the blocking `send`, each waits for a receive
      its neighbour never reaches. Post the send with `request = dist.isend(...)`, then
      `dist.recv(...)`, then `request.wait()`.
    - Copy the chunks before adding into them (`np.array_split` returns views of x).
    - Use only dist.send / recv / isend / irecv (and ring_neighbours): the checker refuses
      dist.all_reduce, reduce_scatter, all_gather and the library's ring_* functions.
    """
    raise NotImplementedError("ring_all_reduce: your code here")
