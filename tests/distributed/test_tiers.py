"""The host and NVMe tiers behind each virtual GPU: ledgers, copies, and their price."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist

PROFILE = dist.DeviceProfile()


def run(fn):
    """fn() on one virtual rank; returns (fn's result, the rank's Device)."""
    results, devices = dist.launch(fn, 1, return_devices=True)
    return results[0], devices[0]


def test_a_blocking_copy_books_its_bytes_and_costs_alpha_plus_size_over_bandwidth():
    def worker():
        gpu = dist.hold(np.ones(1000, np.float32), "grads")
        host = dist.copy_to_host(gpu, "grads")
        return host

    host, device = run(worker)
    assert device.memory_host.current["grads"] == host.nbytes == 4000
    assert device.memory.current["grads"] == 4000  # the GPU copy is still held
    assert device.transfers.bytes["to_host"] == 4000
    expected = PROFILE.pcie_latency + 4000 / PROFILE.pcie_bandwidth
    assert device.clock.now == pytest.approx(expected, rel=1e-12)
    assert device.clock.transfer_s == device.clock.now
    assert [e.kind for e in device.clock.events] == ["transfer"]


def test_an_async_copy_runs_while_the_rank_computes_and_is_waited_for_once():
    def worker():
        device = dist.get_device()
        dist.copy_to_host(np.ones(10**6, np.float32), async_op=True)
        after_post = device.clock.now
        device.compute(PROFILE.flops * 1e-5, "backward")  # 10 us of compute
        dist.wait_transfers()
        return after_post

    after_post, device = run(worker)
    copy = PROFILE.pcie_latency + 4e6 / PROFILE.pcie_bandwidth  # 90 us
    assert after_post == 0.0
    assert device.clock.now == pytest.approx(copy, rel=1e-12)  # overlapped, not added
    assert device.clock.transfer_s == pytest.approx(copy - 1e-5, rel=1e-9)


def test_pcie_is_full_duplex_and_copies_in_one_direction_queue():
    def worker():
        dist.copy_to_host(np.ones(1000), async_op=True)
        dist.copy_to_host(np.ones(1000), async_op=True)  # waits for the first
        dist.copy_to_device(np.ones(1000))               # the other direction: at once
        up = dist.get_device().clock.now
        dist.wait_transfers()
        return up

    up, device = run(worker)
    one = PROFILE.pcie_latency + 8000 / PROFILE.pcie_bandwidth
    assert up == pytest.approx(one, rel=1e-12)
    assert device.clock.now == pytest.approx(2 * one, rel=1e-12)
    assert device.transfers.copies == {"to_host": 2, "to_device": 1, "nvme_read": 0,
                                       "nvme_write": 0}


def test_nvme_swap_in_is_a_host_buffer_for_the_block_and_swap_out_writes_it_back():
    def worker():
        state = dist.hold(np.arange(4.0), "optimizer", tier="nvme")
        with dist.swap_in(state, "optimizer") as host:
            held_inside = dist.get_device().memory_host.current["optimizer"]
            host += 1
            dist.swap_out(host, state)
        return state, held_inside

    (state, held_inside), device = run(worker)
    np.testing.assert_array_equal(state, [1.0, 2.0, 3.0, 4.0])
    assert held_inside == 32 and device.memory_host.current["optimizer"] == 0
    assert device.memory_nvme.current["optimizer"] == 32
    assert device.transfers.bytes["nvme_read"] == device.transfers.bytes["nvme_write"] == 32
    expected = (2 * PROFILE.nvme_latency + 32 / PROFILE.nvme_read_bandwidth
                + 32 / PROFILE.nvme_write_bandwidth)
    assert device.clock.now == pytest.approx(expected, rel=1e-12)


def test_release_finds_the_tier_that_holds_the_array():
    def worker():
        a = dist.hold(np.ones(8), "optimizer", tier="host")
        dist.release(a)
        return dist.get_device().memory_host.peak["optimizer"]

    peak, device = run(worker)
    assert peak == 64 and device.memory_host.current["optimizer"] == 0


def test_host_compute_is_priced_at_the_host_flop_rate():
    def worker():
        dist.host_compute(PROFILE.host_flops * 2e-3)

    _, device = run(worker)
    assert device.clock.host_compute_s == pytest.approx(2e-3)
    assert device.clock.compute_s == 0
    assert [e.kind for e in device.clock.events] == ["host_optimizer"]


def test_every_tier_reports_the_gpu_ledger_keys_and_transfers_their_four_totals():
    _, device = run(lambda: None)
    summary = device.summary()
    assert set(summary["memory_host"]) == set(summary["memory_nvme"]) == set(summary["memory"])
    assert {"to_host_bytes", "to_device_bytes", "nvme_read_bytes",
            "nvme_write_bytes"} <= set(summary["transfers"])
    assert set(summary["time"]) == {"compute_s", "comm_s", "idle_s"}  # no offload: as before


def test_unknown_tier_and_bad_profile_are_clear_errors():
    with pytest.raises(ValueError, match="memory tier 'ssd'"):
        run(lambda: dist.hold(np.ones(2), "params", tier="ssd"))
    with pytest.raises(ValueError, match="pcie_bandwidth must be > 0"):
        dist.DeviceProfile(pcie_bandwidth=0)
