"""Where the autograd engine reports what it costs.

The engine knows two things a cluster simulator needs: the FLOPs of every op it runs,
and the arrays each op saves for backward. It reports both to the *current device*:
an object that `minipar.distributed` installs for each virtual rank (a contextvar, so every
rank's thread sees its own device and nothing is shared). Outside a launch there is
no device and nothing is recorded, so the engine also works as a plain library.

A device is anything with
    device.compute(flops: float, kind: str)      # "forward" | "backward" | "optimizer"
    device.memory.hold(array, category: str)     # "params" | "grads" | "optimizer" |
    device.memory.release(array)                 # "activations" | "buffers"
    device.phase                                 # optional, read/write: the phase
                                                 # communication is charged to
                                                 # ("backward" during a backward pass)
A device that records a profiler trace (its `trace` attribute is not None) also takes the
op's name: `device.compute(flops, kind, op="Linear")`; `charge` calls it either way.
(`minipar.distributed.Device` is the real one.) While activation checkpointing runs a
forward again inside backward, `is_recomputing()` is true, so a device can tell the
recomputed FLOPs (reported as "forward", which they are) from the first forward's.
Keeping the protocol here, and the bookkeeping in `minipar.distributed`, keeps the
engine free of ledgers and clocks.

Optionally, a device whose ranks take turns on the host's cores (minipar.distributed's:
one runs Python at a time) has `device.lend_turn(flops) -> bool` and `device.take_turn()`:
an op about to spend `flops` in one NumPy call that releases the GIL (a GEMM) wraps it in
`with long_call(flops):`, so that the next rank can run its Python on another core
meanwhile, as a GPU computes while its host goes on.
"""

from __future__ import annotations

import contextlib
import contextvars

_current_device: contextvars.ContextVar = contextvars.ContextVar("minipar_device", default=None)
_recomputing: contextvars.ContextVar = contextvars.ContextVar("minipar_recomputing",
                                                              default=False)


def current_device():
    """The device of the running virtual rank, or None outside `minipar.distributed.launch`."""
    return _current_device.get()


@contextlib.contextmanager
def use_device(device):
    """Make `device` the current device inside the `with` block (this thread/context only)."""
    token = _current_device.set(device)
    try:
        yield device
    finally:
        _current_device.reset(token)


@contextlib.contextmanager
def device_phase(device, name: str):
    """Set `device.phase` to `name` inside the block and restore it after (no-op without
    a device). The engine runs every backward pass inside `device_phase(d, "backward")`,
    so what a backward hook communicates (a gradient reduction, a ZeRO-3 gather, a
    sequence-parallel all-gather) is charged to backward without the caller saying so.
    A device without a `phase` (one that only counts FLOPs and bytes) is left alone."""
    if device is None or not hasattr(device, "phase"):
        yield
        return
    previous = device.phase
    device.phase = name
    try:
        yield
    finally:
        device.phase = previous


@contextlib.contextmanager
def recomputing():
    """Mark the ops run inside the block as a recomputation (checkpoint.py's backward)."""
    token = _recomputing.set(True)
    try:
        yield
    finally:
        _recomputing.reset(token)


def is_recomputing() -> bool:
    """True while a checkpointed function's forward runs again during backward."""
    return _recomputing.get()


# A GEMM this long is worth lending the turn for: 0.07-0.2 ms on one core (an AMD EPYC:
# fp32 on AVX-512 kernels to fp64 on AVX2 ones), against ~20-40 us of CPU to hand the
# turn over and take it back.
LONG_CALL_FLOPS = 10e6


class long_call:  # noqa: N801 - used as a context manager, like a function
    """`with long_call(flops): y = a @ b`: lend the device's turn during one long NumPy
    call that releases the GIL (module docstring); nothing without such a device."""

    __slots__ = ("device",)

    def __init__(self, flops: float):
        device = _current_device.get() if flops >= LONG_CALL_FLOPS else None
        if device is not None and not (hasattr(device, "lend_turn")
                                       and device.lend_turn(flops)):
            device = None
        self.device = device

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        if self.device is not None:
            self.device.take_turn()


def charge(device, flops: float, kind: str, op: str, kernels=None) -> None:
    """device.compute(flops, kind[, kernels]), naming the op when the device records a trace."""
    if getattr(device, "trace", None) is not None:
        device.compute(flops, kind, kernels, op=op)
    elif kernels is None:
        device.compute(flops, kind)
    else:
        device.compute(flops, kind, kernels)
