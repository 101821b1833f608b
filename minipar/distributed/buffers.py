"""Buffer lifetimes, booked in the running rank's memory ledger, so strategy code does not.

A strategy (DDP, ZeRO, a pipeline) says *what* lives and for how long; this module does the
bookkeeping in the rank's `MemoryLedger` (memory.py):

    with dist.transient(averaged):        # a buffer alive only inside the block
        p.grad[...] = averaged            #   ("buffers" unless told otherwise)
    dist.hold(shard, "optimizer")         # an array that lives on (returns it)
    dist.release(shard)                   # ... until here
    dist.hold(state, "optimizer", tier="host")   # in host memory (ZeRO-Offload)

The collectives and `recv` take `category=` to book the array they return themselves
(`dist.reduce_scatter(flat, category="buffers")`): the result is counted from the moment
the rank has it (for `async_op=True`, from `wait()`), exactly as if the caller had held it
on the next line.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .context import get_device


def hold(array: np.ndarray, category: str, tier: str = "gpu") -> np.ndarray:
    """Count `array` in the running rank's ledger of `tier` (gpu, host or nvme: see
    tiers.py) under `category`; returns `array`."""
    get_device().ledger(tier).hold(array, category)
    return array


def release(array: np.ndarray) -> None:
    """Stop counting `array` (one hold of its root buffer) in the ledger of the tier that
    holds it (the GPU's if none does: its error names the array)."""
    device = get_device()
    (device.ledger_holding(array) or device.memory).release(array)


@contextlib.contextmanager
def transient(array: np.ndarray, category: str = "buffers", tier: str = "gpu"):
    """Count `array` under `category` (in `tier`'s ledger) inside the `with` block only
    (a transient buffer: a gathered copy, a reduction's result being scattered into
    place). Yields `array`. The ledger releases it on leaving the block, also when the
    block raises."""
    memory = get_device().ledger(tier)
    memory.hold(array, category)
    try:
        yield array
    finally:
        memory.release(array)


def compute(flops: float, kind: str, kernels=()) -> None:
    """Charge the running rank's clock now with `flops` of `kind` work (forward |
    backward), run as `kernels` on a roofline profile. For an op that interleaves its
    compute with its communication (ring attention overlaps each block with the K/V
    transfer), so each piece lands on the timeline where it runs; such an op reports no
    FLOPs of its own to the autograd engine (flops 0, kernels_backward ())."""
    device = get_device()
    device.compute(flops, kind, tuple(kernels) if device.wants_kernels else None)
