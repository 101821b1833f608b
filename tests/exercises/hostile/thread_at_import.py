"""A correct ring whose import starts a thread that is not a daemon (daemon=False: a
thread started by a daemon thread would be one), which the interpreter waits for before
it exits."""

import threading
import time

import numpy as np

from minipar import distributed as dist

threading.Thread(target=time.sleep, args=(60,), name="left running", daemon=False).start()


def ring_neighbours(group=None):
    ranks = list(range(dist.get_world_size())) if group is None else list(group.ranks)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def ring_all_reduce(x, group=None):
    i, n, successor, predecessor = ring_neighbours(group)
    chunks = [c.copy() for c in np.array_split(np.asarray(x).reshape(-1), n)]

    def exchange(outgoing):
        request = dist.isend(outgoing, successor, group=group)
        incoming = dist.recv(predecessor, group=group)
        request.wait()
        return incoming

    for s in range(n - 1):
        chunks[(i - s - 1) % n] += exchange(chunks[(i - s) % n])
    for s in range(n - 1):
        chunks[(i - s) % n] = exchange(chunks[(i + 1 - s) % n])
    return np.concatenate(chunks).reshape(x.shape)
