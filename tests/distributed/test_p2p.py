"""send / recv / isend / irecv: values, ordering, bytes and simulated time."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist

PROFILE = dist.DeviceProfile(
    flops=1e12,
    intra_node_bandwidth=100e9,
    inter_node_bandwidth=10e9,
    intra_node_latency=1e-6,
    inter_node_latency=5e-6,
)


def test_send_recv_values_order_and_tags():
    def worker():
        if dist.get_rank() == 0:
            x = np.arange(3.0)
            dist.isend(x, 1, tag=7)
            for i in range(3):
                dist.isend(x + i, 1)
            x[:] = -1  # isend copied the message: this must not be received
            return None
        late = dist.recv(0, tag=7)
        first, second, third = (dist.recv(0) for _ in range(3))
        return late, first, second, third

    results = dist.launch(worker, 2)
    late, first, second, third = results[1]
    np.testing.assert_array_equal(late, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(np.stack([first, second, third])[:, 0], [0.0, 1.0, 2.0])


def test_exchange_with_isend_irecv():
    def worker():
        rank = dist.get_rank()
        peer = 1 - rank
        incoming = dist.irecv(peer)
        outgoing = dist.isend(np.full(2, rank), peer)
        assert outgoing.wait() is None
        return incoming.wait(), incoming.wait()  # waiting twice is harmless

    results, devices = dist.launch(worker, 2, return_devices=True)
    assert [int(r[0][0]) for r in results] == [1, 0]
    assert [d.comm.calls for d in devices] == [2, 2]  # booked once each


def test_bytes_group_kind_and_traffic():
    def worker():
        pp = dist.new_group([0, 1], kind="pp")
        if dist.get_rank() == 0:
            with dist.phase("forward"):
                dist.send(np.zeros(10, np.float32), 1, group=pp)
        else:
            dist.recv(0, group=pp)

    _, devices = dist.launch(worker, 2, return_devices=True)
    (sent,), (received,) = devices[0].comm.records, devices[1].comm.records
    assert (sent.op, sent.sent_bytes, sent.recv_bytes, sent.group_kind) == ("send", 40, 0, "pp")
    assert (received.op, received.sent_bytes, received.recv_bytes) == ("recv", 0, 40)
    assert sent.phase == "forward" and received.phase == "other"
    np.testing.assert_array_equal(dist.traffic_matrix([d.comm for d in devices]), [[0, 40], [0, 0]])


def test_recv_completes_no_earlier_than_the_send_arrives():
    S = 1_000_000  # bytes

    def worker():
        device = dist.get_device()
        if dist.get_rank() == 0:
            device.compute(2e12, "forward")  # 2 s of compute before sending
            dist.send(np.zeros(S, np.uint8), 1)
        else:
            dist.recv(0)  # posted at t = 0
        return device.clock.now

    results, devices = dist.launch(worker, 2, device=PROFILE, return_devices=True)
    transfer = 1e-6 + S / 100e9  # alpha + S/B on NVLink
    assert results[0] == pytest.approx(2.0 + transfer)
    assert results[1] == pytest.approx(2.0 + transfer)
    assert devices[1].clock.idle_s == pytest.approx(2.0)
    assert devices[1].clock.comm_s == pytest.approx(transfer)


def test_isend_does_not_advance_the_sender_until_wait():
    S = 1_000_000

    def worker():
        device = dist.get_device()
        if dist.get_rank() == 0:
            work = dist.isend(np.zeros(S, np.uint8), 8)  # rank 8 is on the second node
            after_post = device.clock.now
            device.compute(1e6, "forward")  # 1 us: the transfer runs meanwhile
            work.wait()
            return after_post, device.clock.now
        if dist.get_rank() == 8:
            dist.recv(0)
        return None

    results = dist.launch(worker, 16, device=PROFILE)
    after_post, after_wait = results[0]
    assert after_post == 0.0
    assert after_wait == pytest.approx(5e-6 + S / 10e9)  # inter-node alpha + S/B


def test_p2p_bad_peers():
    with pytest.raises(ValueError, match="outside the world of 2 ranks"):
        dist.launch(lambda: dist.send(np.zeros(1), 5), 2)
    with pytest.raises(ValueError, match="to/from itself"):
        dist.launch(lambda: dist.recv(dist.get_rank()), 2)
    with pytest.raises(ValueError, match="must both be in"):
        dist.launch(
            lambda: dist.recv(1, group=dist.new_group([0])) if dist.get_rank() == 0 else 0, 2
        )
