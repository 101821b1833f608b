"""Host memory for the ranks' arrays: freed blocks kept in the process for the next step.

A training step allocates the same activations and gradients every micro-batch: tens to
hundreds of arrays of 0.1-1 MB each. glibc's malloc serves a block above its mmap
threshold (128 KiB at first, raised as such blocks are freed) with a fresh mmap, and
returns free memory at the top of its heaps once it passes the trim threshold; either way
the next micro-batch's array lands on pages the kernel must fault in and zero again: the
demo's 8-rank step made ~33k minor faults and spent ~60 ms of system time on them, ~12% of
its CPU (benchmarks/README.md, "the emulator's own cost").

So a launch raises both thresholds, once per process: blocks up to MMAP_THRESHOLD come
from the heaps, and freed memory stays in them for reuse, as PyTorch's caching allocator
keeps freed GPU blocks for the next allocation instead of returning them to the driver
(c10/cuda/CUDACachingAllocator.cpp). The cost: the process keeps the largest amount of
memory a run used until it exits. Nothing measured changes: the memory ledger counts
`nbytes`, not pages. Only glibc has `mallopt`; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); the
# demo's arrays are under 1 MB.
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 512 * 2**20

_lock = threading.Lock()
_set: bool | None = None  # None: not tried yet in this process


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True if set."""
    global _set
    with _lock:
        if _set is None:
            _set = _mallopt()
        return _set


def _mallopt() -> bool:
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
