"""MemoryLedger: root buffers, reference counts, peaks per category and of the total."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.distributed import MemoryLedger


def test_hold_release_and_peaks():
    ledger = MemoryLedger()
    params = np.zeros(100)  # 800 bytes
    grads = np.zeros(50)  # 400 bytes
    activation = np.zeros(25, np.float32)  # 100 bytes
    ledger.hold(params, "params")
    ledger.hold(activation, "activations")
    ledger.release(activation)
    ledger.hold(grads, "grads")
    assert ledger.current == {
        "params": 800,
        "grads": 400,
        "optimizer": 0,
        "activations": 0,
        "buffers": 0,
    }
    summary = ledger.summary()
    assert summary["activations"] == 100  # peak per category
    assert summary["peak_total"] == 1200  # 800 + 400 > 800 + 100; not the sum of peaks (1300)


def test_views_and_repeated_holds_count_the_root_buffer_once():
    ledger = MemoryLedger()
    buffer = np.zeros((10, 10))  # 800 bytes
    ledger.hold(buffer[2:5], "buffers")  # a view: the whole root buffer is held
    assert ledger.current["buffers"] == 800
    ledger.hold(buffer.reshape(-1)[::2], "params")  # another view: same root, no bytes
    ledger.hold(buffer, "buffers")
    assert ledger.total == 800
    ledger.release(buffer)
    ledger.release(buffer[0])
    assert ledger.total == 800  # one hold left
    ledger.release(buffer[1])
    assert ledger.total == 0 and ledger.peak_total == 800
    assert not ledger.is_held(buffer)


def test_misuse_is_a_clear_error():
    ledger = MemoryLedger()
    with pytest.raises(ValueError, match="category 'weights'"):
        ledger.hold(np.zeros(1), "weights")
    with pytest.raises(ValueError, match="not held"):
        ledger.release(np.zeros(1))


def test_the_ledger_records_what_was_held_at_the_peak():
    ledger = MemoryLedger()
    ledger.moment = lambda: (1.5, "forward")
    a, b = np.zeros(100), np.zeros(10)
    ledger.hold(a, "activations")
    ledger.hold(b, "params")
    ledger.release(a)
    ledger.hold(np.zeros(50), "grads")  # 480 bytes now: below the 880-byte peak
    assert ledger.peak_total == 880
    assert ledger.at_peak == {"params": 80, "grads": 0, "optimizer": 0, "activations": 800,
                              "buffers": 0, "time_s": 1.5, "phase": "forward"}
