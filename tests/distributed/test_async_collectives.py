"""Asynchronous collectives (async_op=True): same results and bytes as the blocking ones,
and on the simulated clock a transfer overlaps the compute issued after it."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist

NO_LATENCY = dist.DeviceProfile(flops=1e12, intra_node_latency=0.0, inter_node_latency=0.0)


def test_async_results_and_bytes_equal_the_blocking_calls():
    n = 4
    data = np.random.default_rng(0).standard_normal((n, 8))

    def worker(async_op):
        x = data[dist.get_rank()]
        calls = [dist.all_reduce(x, op="avg", async_op=async_op),
                 dist.all_gather(x[:2], async_op=async_op),
                 dist.reduce_scatter(x, async_op=async_op)]
        return [c.wait() if async_op else c for c in calls]

    blocking, devices_b = dist.launch(worker, n, False, return_devices=True)
    overlapped, devices_a = dist.launch(worker, n, True, return_devices=True)
    for b, a in zip(blocking, overlapped, strict=True):
        for x, y in zip(b, a, strict=True):
            assert x.tobytes() == y.tobytes()
    np.testing.assert_allclose(overlapped[0][0], data.mean(0), rtol=1e-12)
    for b, a in zip(devices_b, devices_a, strict=True):
        assert b.comm.summary() == a.comm.summary()


def test_compute_after_an_async_all_reduce_hides_its_time():
    n, nbytes = 2, 8 * 1000
    ring = dist.collective_time("all_reduce", n, nbytes, 0.0, NO_LATENCY.intra_node_bandwidth)

    def worker(async_op, compute_s):
        device = dist.get_device()
        work = dist.all_reduce(np.zeros(1000), async_op=async_op)
        device.compute(compute_s * 1e12, "backward")  # flops at 1e12 FLOP/s
        if async_op:
            work.wait()
        return device.clock.summary(), device.clock.now

    # Blocking: the transfer, then the compute.
    (summary, now), _ = dist.launch(worker, n, False, 2 * ring, device=NO_LATENCY)
    assert summary["comm_s"] == pytest.approx(ring) and now == pytest.approx(3 * ring)
    # Async with more compute than transfer: the transfer is hidden entirely.
    (summary, now), _ = dist.launch(worker, n, True, 2 * ring, device=NO_LATENCY)
    assert summary["comm_s"] == 0 and now == pytest.approx(2 * ring)
    # Async with less compute: only the rest of the transfer is waited for.
    (summary, now), _ = dist.launch(worker, n, True, ring / 4, device=NO_LATENCY)
    assert summary["comm_s"] == pytest.approx(3 * ring / 4) and now == pytest.approx(ring)


def test_collectives_of_one_group_run_one_after_another():
    """Like the NCCL stream of a communicator: a second async call starts when the first
    ends, even though both were posted at time 0. Another group is not held up."""
    n, nbytes = 4, 8 * 1000
    ring = dist.collective_time("all_reduce", n, nbytes, 0.0, NO_LATENCY.intra_node_bandwidth)

    def worker():
        first = dist.all_reduce(np.zeros(1000), async_op=True)
        second = dist.all_reduce(np.zeros(1000), async_op=True)
        pair = dist.new_group([0, 1] if dist.get_rank() < 2 else [2, 3])
        third = dist.all_reduce(np.zeros(1000), group=pair, async_op=True)
        for work in (first, second, third):
            work.wait()
        return [(r.start, r.end) for r in dist.get_device().comm.records]

    records = dist.launch(worker, n, device=NO_LATENCY)[0]
    pair_ring = dist.collective_time("all_reduce", 2, nbytes, 0.0,
                                     NO_LATENCY.intra_node_bandwidth)
    assert records[0] == pytest.approx((0.0, ring))
    assert records[1] == pytest.approx((ring, 2 * ring))
    assert records[2] == pytest.approx((0.0, pair_ring))


def test_phase_is_the_one_the_call_was_made_in():
    def worker():
        with dist.phase("backward"):
            work = dist.reduce_scatter(np.zeros(4), async_op=True)
        with dist.phase("optimizer"):
            work.wait()
        return [r.phase for r in dist.get_device().comm.records]

    assert dist.launch(worker, 2) == [["backward"], ["backward"]]


def test_a_forgotten_work_is_still_booked_when_the_rank_returns():
    def worker():
        dist.all_reduce(np.zeros(4), async_op=True)  # never waited

    _, devices = dist.launch(worker, 2, return_devices=True)
    assert all(d.comm.calls == 1 and d.comm.sent_bytes > 0 for d in devices)


def test_a_group_of_one_completes_at_once():
    def worker():
        work = dist.all_gather(np.arange(3.0), group=dist.new_group([dist.get_rank()]),
                               async_op=True)
        return work.is_completed(), work.wait()

    for done, result in dist.launch(worker, 2):
        assert done
        np.testing.assert_array_equal(result, np.arange(3.0))


def test_waiting_for_a_peer_that_never_joins_is_a_deadlock_error():
    def worker():
        if dist.get_rank() == 0:
            dist.all_reduce(np.zeros(2), async_op=True).wait()

    with pytest.raises(dist.DeadlockError, match="rank 0 waits all_reduce"):
        dist.launch(worker, 2)


def test_all_gather_into_a_buffer_the_caller_allocated():
    """all_gather(out=) (torch's all_gather_into_tensor): the result lands in, and is,
    the caller's array, so a prefetch can book its buffer before the transfer starts."""
    def worker():
        rank = dist.get_rank()
        out = dist.hold(np.empty(4), "buffers")
        booked = dist.get_device().memory.current["buffers"]
        work = dist.all_gather(np.full(2, float(rank)), async_op=True, out=out)
        result = work.wait()
        with pytest.raises(ValueError, match="out has shape"):
            dist.all_gather(np.zeros(2), out=np.empty(3))
        with pytest.raises(ValueError, match="not both"):
            dist.all_gather(np.zeros(2), out=np.empty(4), category="buffers")
        return result is out, out.tolist(), booked, dist.get_device().memory.current["buffers"]

    for same, values, before, after in dist.launch(worker, 2):
        assert same and values == [0.0, 0.0, 1.0, 1.0]
        assert before == after == 32  # the buffer, booked once, from before the call
