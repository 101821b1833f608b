"""How the gradient engines' arrays are booked in the rank's memory ledgers: by role.

Every array a data-parallel engine keeps counts in one category of the rank's ledger
(params, grads, optimizer, buffers: minipar/distributed/memory.py) and lives in one tier
(gpu, host, nvme: minipar/distributed/tiers.py). Which one is a property of the array's
role, so it is declared once, where the role is, and the algorithms' lines only say what
exists and when:

    class ShardedBucket:                      # minipar/parallel/zero/partition.py
        master = Held("optimizer")            # the role, declared once
    sb.master = shard.astype(np.float32)      # booked from here ...
    sb.master = None                          # ... to here

A `Held` attribute books the array assigned to it and releases the one it replaces. An
instance may book one of its attributes otherwise than its class declares, through its
`booking` dict {attribute: (category, tier)}: ZeRO-1's gradient shard is a buffer (the
full p.grad is its gradient), an offloaded optimizer's state lives on the host. The
ledger counts root buffers, so assigning a view of an array already held adds no bytes.

`hold_replica` and `hold_buffer` book what has no such home: the whole replica a DDP
rank keeps, and the flat copy of a bucket's gradients a collective reduces.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist


class Held:
    """A class attribute whose array is booked in the rank's ledger while it is set.

    category: the ledger category of the role (params, grads, optimizer, buffers); the
    tier is the GPU's, unless the instance's `booking` says otherwise.
    """

    def __init__(self, category: str):
        self.category = category

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return instance.__dict__.get(self.name)

    def __set__(self, instance, array) -> None:
        old = instance.__dict__.get(self.name)
        if array is old:  # an in-place update (`sb.grad_shard += piece`)
            return
        if array is not None:
            category, tier = instance.__dict__.get("booking", {}).get(
                self.name, (self.category, "gpu"))
            dist.hold(array, category, tier)
        instance.__dict__[self.name] = array
        if old is not None:
            dist.release(old)


def hold_replica(params) -> None:
    """Book the arrays of `params` as the rank's parameters (DDP: every rank keeps the
    whole model)."""
    for p in params:
        dist.hold(p.data, "params")


def hold_buffer(array: np.ndarray) -> np.ndarray:
    """Book `array` as a buffer until the caller releases it (`dist.release`)."""
    return dist.hold(array, "buffers")
