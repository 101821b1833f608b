"""Suite-wide test setup.

Library tests draw on `matplotlib.figure.Figure` and never show anything: pin the
non-interactive Agg backend for this process only. (CI must not export MPLBACKEND=Agg:
the notebooks that tests/test_notebooks.py executes would inherit it and lose every
figure.)

The explorers' answers on disk (minipar/viz/store.py) are off for the whole suite, the
notebooks' kernels included (they inherit the environment): a test must measure and
draw what it checks, and must not write to the user's ~/.cache. tests/viz/test_store.py
turns the store on, in a temporary directory.

The `device` fixture is a tiny stand-in for a virtual GPU: the device protocol of
minipar.autograd.tracking with a ledger that follows the semantics of
minipar.distributed.memory (root buffers, reference counts, per-category peaks). The autograd
and nn tests use it so they do not depend on the layer below them (minipar.distributed).
"""

from __future__ import annotations

import os
import subprocess
from collections import defaultdict

import matplotlib
import numpy as np
import pytest

from minipar.autograd.tracking import use_device

matplotlib.use("Agg")
os.environ["MINIPAR_CACHE_DIR"] = "off"


class FakeLedger:
    def __init__(self):
        self.entries = {}  # id(root) -> [root, count, category]
        self.current = defaultdict(int)
        self.peak = defaultdict(int)
        self.peak_total = 0

    @staticmethod
    def _root(array):
        while isinstance(array.base, np.ndarray):
            array = array.base
        return array

    def hold(self, array, category):
        root = self._root(array)
        entry = self.entries.get(id(root))
        if entry is not None:
            entry[1] += 1
            return
        self.entries[id(root)] = [root, 1, category]
        self.current[category] += root.nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, sum(self.current.values()))

    def release(self, array):
        root = self._root(array)
        entry = self.entries[id(root)]  # KeyError: released something never held
        entry[1] -= 1
        if entry[1] == 0:
            del self.entries[id(root)]
            self.current[entry[2]] -= root.nbytes


class FakeDevice:
    def __init__(self):
        self.memory = FakeLedger()
        self.flops = defaultdict(float)

    def compute(self, flops, kind):
        assert kind in ("forward", "backward", "optimizer"), kind
        self.flops[kind] += flops


@pytest.fixture
def device():
    """A FakeDevice installed as the current device for the test."""
    fake = FakeDevice()
    with use_device(fake):
        yield fake


@pytest.fixture
def small_disk(tmp_path):
    """small_disk("600k"): a new directory on a tmpfs of that size, a disk that fills up
    (mounted for the test, unmounted after it). Skips where mounting is not allowed (it
    needs root on Linux)."""
    mounted = []

    def mount(size: str):
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        try:
            result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                     str(point)], capture_output=True, text=True)
        except OSError as err:
            result = subprocess.CompletedProcess([], 1, "", str(err))
        if result.returncode != 0:
            pytest.skip(f"cannot mount a {size} tmpfs here ({result.stderr.strip()}): a "
                        "full disk needs root on Linux")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)
