"""Device: the autograd device protocol, phases and the report summary."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd import tracking


def test_device_is_the_autograd_current_device_in_each_rank():
    def worker():
        device = tracking.current_device()
        assert device is dist.get_device()
        device.memory.hold(np.zeros(dist.get_rank() + 1), "params")
        device.compute(1e12, "forward")
        return device.rank, device.node

    results, devices = dist.launch(worker, 4, gpus_per_node=2, return_devices=True)
    assert results == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert tracking.current_device() is None  # nothing leaks into the caller
    assert [d.memory.summary()["params"] for d in devices] == [8, 16, 24, 32]


def test_summary_has_the_report_shape():
    def worker():
        device = dist.get_device()
        device.memory.hold(np.zeros(4), "optimizer")
        dist.all_reduce(np.zeros(4))
        return device.summary()

    summary = dist.launch(worker, 2)[1]
    assert summary["rank"] == 1 and summary["node"] == 0
    assert set(summary["memory"]) == {
        "params",
        "grads",
        "optimizer",
        "activations",
        "buffers",
        "peak_total",
    }
    assert summary["memory"]["optimizer"] == 32
    assert {"sent_bytes", "recv_bytes", "calls", "by_op", "by_group"} <= set(summary["comm"])
    assert set(summary["time"]) == {"compute_s", "comm_s", "idle_s"}
    assert summary["comm"]["by_op"] == {"all_reduce": 32}


def test_phase_context_manager_restores_and_validates():
    def worker():
        device = dist.get_device()
        with dist.phase("optimizer"):
            inside = device.phase
        return inside, device.phase

    assert dist.launch(worker, 1) == [("optimizer", "other")]
    with pytest.raises(ValueError, match="phase 'fwd'"):
        dist.launch(lambda: dist.phase("fwd").__enter__(), 1)


def test_standalone_device_outside_a_launch():
    device = dist.Device(rank=0, world_size=1)
    with tracking.use_device(device):
        tracking.current_device().compute(device.profile.flops, "forward")
    assert device.clock.compute_s == pytest.approx(1.0)
