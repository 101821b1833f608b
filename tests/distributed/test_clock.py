"""The simulated clock: compute from FLOPs, alpha-beta collectives, idle for early ranks,
and a two-node placement slower by the bandwidth ratio."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.distributed.clock import Clock

NO_LATENCY = dist.DeviceProfile(intra_node_latency=0.0, inter_node_latency=0.0)


def test_default_profile_is_an_h100_node():
    profile = dist.DeviceProfile()
    assert profile.intra_node_bandwidth == 450e9  # NVLink 4: 900 GB/s bidirectional
    assert profile.inter_node_bandwidth == 400e9 / 8  # 400 Gb/s NDR InfiniBand
    assert 0 < profile.flops <= 989.4e12  # at most the dense BF16 datasheet peak
    assert 0 < profile.intra_node_latency < profile.inter_node_latency < 1e-4


def test_bad_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="intra_node_bandwidth must be > 0"):
        dist.DeviceProfile(intra_node_bandwidth=0)
    with pytest.raises(TypeError, match="DeviceProfile"):
        dist.launch(lambda: None, 2, device="H100")


def test_compute_advances_by_flops_and_merges_contiguous_events():
    clock = Clock()
    for _ in range(100):
        clock.compute(0.01, "forward")
    clock.compute(0.5, "backward")
    clock.wait_until(2.0)
    clock.communicate(2.5, 3.0, "all_reduce dp")
    assert [e.kind for e in clock.events] == ["forward", "backward", "idle", "comm"]
    assert clock.events[0].duration == pytest.approx(1.0)
    assert clock.summary() == pytest.approx({"compute_s": 1.5, "comm_s": 0.5, "idle_s": 1.0})
    assert clock.now == 3.0


def test_device_compute_uses_the_profile():
    def worker():
        device = dist.get_device()
        device.compute(4e12, "forward")
        device.compute(8e12, "backward")
        device.compute(1e12, "optimizer")
        return device.clock.summary()

    (summary,) = dist.launch(worker, 1, device=dist.DeviceProfile(flops=1e12))
    assert summary == {"compute_s": 13.0, "comm_s": 0.0, "idle_s": 0.0}
    with pytest.raises(ValueError, match="compute kind 'sideways'"):
        dist.launch(lambda: dist.get_device().compute(1.0, "sideways"), 1)


def test_collective_starts_with_its_last_member_and_costs_the_ring_time():
    n, S = 4, 8 * 1000  # float64 x 1000
    profile = dist.DeviceProfile(flops=1e12)

    def worker():
        device = dist.get_device()
        device.compute(1e9 * dist.get_rank(), "forward")  # rank r arrives at r ms
        dist.all_reduce(np.zeros(1000))
        return device.clock.summary(), device.comm.records[0]

    results = dist.launch(worker, n, device=profile)
    alpha, B = profile.intra_node_latency, profile.intra_node_bandwidth
    ring_time = 2 * (n - 1) * alpha + 2 * (n - 1) / n * S / B
    for rank, (summary, record) in enumerate(results):
        assert record.start == pytest.approx(3e-3)
        assert record.end == pytest.approx(3e-3 + ring_time)
        assert summary["idle_s"] == pytest.approx(3e-3 - rank * 1e-3)
        assert summary["comm_s"] == pytest.approx(ring_time)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_two_nodes_are_slower_by_the_bandwidth_ratio(op):
    def worker():
        x = np.zeros(8 * 1024, np.float32)
        getattr(dist, op)(x)
        return dist.get_device().clock.now

    one_node = dist.launch(worker, 8, gpus_per_node=8, device=NO_LATENCY)
    two_nodes = dist.launch(worker, 8, gpus_per_node=4, device=NO_LATENCY)
    ratio = NO_LATENCY.intra_node_bandwidth / NO_LATENCY.inter_node_bandwidth
    assert two_nodes[0] / one_node[0] == pytest.approx(ratio, rel=1e-12)
    # With the default latencies the gap is smaller (latency dominates small messages).
    slow = dist.launch(worker, 8, gpus_per_node=4)[0] / dist.launch(worker, 8)[0]
    assert 1 < slow < ratio


def test_collective_time_formulas():
    S, B, a = 1e6, 1e9, 1e-5
    assert dist.collective_time("all_reduce", 4, S, a, B) == pytest.approx(6 * a + 1.5 * S / B)
    assert dist.collective_time("all_gather", 4, S, a, B) == pytest.approx(3 * a + 0.75 * S / B)
    assert dist.collective_time("broadcast", 4, S, a, B) == pytest.approx(3 * a + S / B)
    assert dist.collective_time("all_reduce", 1, S, a, B) == 0.0
    # pairwise exchanges: (n-1) alpha + (n-1)/n S/B, S one rank's buffer
    assert dist.collective_time("all_to_all", 4, S, a, B) == pytest.approx(3 * a + 0.75 * S / B)
    with pytest.raises(ValueError, match="no cost model"):
        dist.collective_time("scatter", 4, S, a, B)


def test_timeline_events_for_plots():
    def worker():
        device = dist.get_device()
        device.compute(1e12 * (1 + dist.get_rank()), "forward")
        dist.all_reduce(np.zeros(4))
        device.compute(1e12, "backward")
        return [(e.kind, e.label) for e in device.clock.events]

    events = dist.launch(worker, 2, device=dist.DeviceProfile(flops=1e12))
    assert events[0] == [
        ("forward", ""),
        ("idle", ""),
        ("comm", "all_reduce other"),
        ("backward", ""),
    ]
    assert events[1] == [("forward", ""), ("comm", "all_reduce other"), ("backward", "")]


def test_timeline_labels_name_compute_events():
    def worker():
        device = dist.get_device()
        for label in ("F0", "F1"):
            with dist.timeline_label(label):
                device.compute(1e12, "forward")  # back to back, but two events
        device.compute(1e12, "forward")  # the label is gone after the block
        return [(e.kind, e.label, e.duration) for e in device.clock.events]

    (events,) = dist.launch(worker, 1, device=dist.DeviceProfile(flops=1e12))
    assert events == [("forward", "F0", 1.0), ("forward", "F1", 1.0), ("forward", "", 1.0)]
