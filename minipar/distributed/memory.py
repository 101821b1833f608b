"""A per-rank ledger of the bytes a rank actually holds, by category.

The autograd engine calls `hold(array, category)` when an array starts living on the rank
and `release(array)` when it stops; strategies do it through `minipar.distributed`
(`dist.hold` / `dist.release` / `with dist.transient(...)` in buffers.py, and the
collectives' `category=`), so the bookkeeping stays out of their algorithm. Bytes come from
`ndarray.nbytes` of the array that owns the buffer, never from a formula, so the ZeRO
savings a student sees are the bytes NumPy really allocated.

Views share memory with their base, so the ledger tracks *root buffers*: it follows
`.base` to the array that owns the memory and reference-counts that. Holding a view of a
held array (or the same array twice, in any category) adds no bytes; the bytes leave the
ledger when the last hold of the root is released. The first hold decides the category.

While a trace is recorded (`record_history`), every change is also appended to `history`
as (simulated time, category, bytes of that category now): the memory counters of the
trace and the moment of the peak come from it. Off by default: nothing is kept.
"""

from __future__ import annotations

import numpy as np

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def check_category(category: str) -> str:
    """`category`, or a ValueError naming the categories."""
    if category not in CATEGORIES:
        raise ValueError(f"memory category {category!r} is not one of {CATEGORIES}")
    return category


def root_array(array: np.ndarray) -> np.ndarray:
    """The ndarray that owns `array`'s memory (follows `.base` through views)."""
    root = array
    while (base := root.base) is not None and isinstance(base, np.ndarray):
        root = base
    return root


class MemoryLedger:
    """Current and peak bytes per category for one rank.

    current[c]  bytes held now in category c
    peak[c]     the largest current[c] ever seen
    peak_total  the largest sum over categories at one instant (not the sum of peaks)
    at_peak     what was held at that instant: bytes per category, and (when a Device
                owns the ledger) the simulated time and phase, so a reader can tell a
                peak at the end of forward (activations) from one in backward (gradients)
    moment      () -> (simulated seconds, phase), set by the owning Device
    """

    def __init__(self) -> None:
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak_total = 0
        self.at_peak: dict = dict.fromkeys(CATEGORIES, 0)
        self.moment = None
        # id(root) -> [root, category, count]. Keeping `root` alive keeps its id unique.
        self._held: dict[int, list] = {}
        self.history: list[tuple[float, str, int]] | None = None  # only while tracing
        self._clock = None

    def record_history(self, clock) -> None:
        """From now on, append (clock.now, category, current bytes) at every change; the
        history starts with the bytes held now (a category at 0 is left out)."""
        self._clock = clock
        self.history = [(clock.now, c, b) for c, b in self.current.items() if b]

    def hold(self, array: np.ndarray, category: str) -> None:
        """Start counting `array` (its root buffer) under `category`."""
        root = array if array.base is None else root_array(array)
        entry = self._held.get(id(root))
        if entry is not None:
            entry[2] += 1
            return
        if category not in CATEGORIES:
            check_category(category)
        nbytes = root.nbytes
        self._held[id(root)] = [root, category, 1]
        current = self.current[category] = self.current[category] + nbytes
        self.total += nbytes
        if current > self.peak[category]:
            self.peak[category] = current
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.at_peak = dict(self.current)
            if self.moment is not None:
                self.at_peak["time_s"], self.at_peak["phase"] = self.moment()
        if self.history is not None:
            self.history.append((self._clock.now, category, current))

    def release(self, array: np.ndarray) -> None:
        """Drop one hold of `array`'s root buffer; its bytes leave at the last release."""
        key = id(array if array.base is None else root_array(array))
        entry = self._held.get(key)
        if entry is None:
            raise ValueError(
                f"release() of an array that is not held (shape {array.shape}, "
                f"dtype {array.dtype}): hold() it first, or release it only once per hold"
            )
        entry[2] -= 1
        if entry[2] == 0:
            del self._held[key]
            root, category, _ = entry
            current = self.current[category] = self.current[category] - root.nbytes
            self.total -= root.nbytes
            if self.history is not None:
                self.history.append((self._clock.now, category, current))

    def is_held(self, array: np.ndarray) -> bool:
        return id(root_array(array)) in self._held

    def summary(self) -> dict:
        """Peak bytes per category and the peak of the total, as in the report."""
        return {**self.peak, "peak_total": self.peak_total}

    def __repr__(self) -> str:
        held = ", ".join(f"{c}={b}" for c, b in self.current.items() if b)
        return f"MemoryLedger({held or 'empty'}; peak_total={self.peak_total})"
