"""Collectives: values against NumPy on the concatenated data, bytes against the ring
formulas, and bit-identical results whatever the thread timing."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.distributed.cluster import Cluster

SIZES = [2, 3, 4, 8]


def per_rank_data(n, shape=(4, 6), dtype=np.float64, seed=0):
    """data[r] is what rank r holds; the full (concatenated) data is the reference."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-100, 100, size=(n, *shape)).astype(dtype)
    return rng.standard_normal((n, *shape)).astype(dtype)


def launch_with_data(fn, data, **kwargs):
    return dist.launch(lambda: fn(data[dist.get_rank()]), len(data), **kwargs)


# --- values -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_values(n):
    ints = per_rank_data(n, dtype=np.int64)
    floats = per_rank_data(n, seed=1)
    for op, reference in [("sum", ints.sum(0)), ("max", ints.max(0)), ("min", ints.min(0))]:
        for result in launch_with_data(lambda x, op=op: dist.all_reduce(x, op=op), ints):
            np.testing.assert_array_equal(result, reference)
            assert result.dtype == np.int64
    for result in launch_with_data(lambda x: dist.all_reduce(x, op="avg"), floats):
        np.testing.assert_allclose(result, floats.mean(0), rtol=1e-12)


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_sums_in_rank_order(n):
    # Values whose float sum depends on the order: the result must be x_0 + x_1 + ...
    data = per_rank_data(n, shape=(64,), dtype=np.float32, seed=2) * np.float32(1e4)
    expected = data[0].copy()
    for x in data[1:]:
        expected = expected + x
    for result in launch_with_data(dist.all_reduce, data):
        assert result.tobytes() == expected.tobytes()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_values(n, dim):
    data = per_rank_data(n, shape=(2, 3))
    expected = np.concatenate(list(data), axis=dim)
    for result in launch_with_data(lambda x: dist.all_gather(x, dim=dim), data):
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_values(n, dim):
    data = per_rank_data(n, shape=(2 * n, 3 * n), dtype=np.int64)
    chunks = np.split(data.sum(0), n, axis=dim)
    results = launch_with_data(lambda x: dist.reduce_scatter(x, dim=dim), data)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result, chunks[rank])
    floats = per_rank_data(n, shape=(n, 2), seed=3)
    results = launch_with_data(lambda x: dist.reduce_scatter(x, op="avg"), floats)
    np.testing.assert_allclose(np.concatenate(results), floats.mean(0), rtol=1e-12)


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_and_reduce_values(n):
    data = per_rank_data(n, dtype=np.int64)
    root = n - 1
    for result in launch_with_data(lambda x: dist.broadcast(x, src=root), data):
        np.testing.assert_array_equal(result, data[root])
    results = launch_with_data(lambda x: dist.reduce(x, dst=1, op="max"), data)
    np.testing.assert_array_equal(results[1], data.max(0))
    assert all(r is None for i, r in enumerate(results) if i != 1)


def test_results_are_independent_copies_and_inputs_untouched():
    def worker():
        x = np.full(4, float(dist.get_rank()))
        y = dist.all_reduce(x)
        y += 100  # must not change any other rank's result
        dist.barrier()
        return x, dist.all_reduce(x)

    for x, y in dist.launch(worker, 4):
        np.testing.assert_array_equal(y, np.full(4, 6.0))
        assert x[0] in (0, 1, 2, 3)


def test_subgroups_and_size_one_group():
    def worker():
        rank = dist.get_rank()
        evens = dist.new_group([0, 2], kind="dp")
        odds = dist.new_group([1, 3], kind="dp")
        mine = evens if rank % 2 == 0 else odds
        alone = dist.new_group([rank])
        x = np.array([float(rank)])
        return dist.all_reduce(x, group=mine), dist.all_reduce(x, group=alone)

    results, devices = dist.launch(worker, 4, return_devices=True)
    assert [float(r[0][0]) for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert [float(r[1][0]) for r in results] == [0.0, 1.0, 2.0, 3.0]
    for d in devices:  # the size-1 all_reduce booked nothing
        assert d.comm.calls == 1 and d.comm.sent_by_group["dp"] == d.comm.sent_bytes


def test_bfloat16_keeps_its_dtype():
    from ml_dtypes import bfloat16

    data = per_rank_data(4, dtype=np.float32).astype(bfloat16)
    for result in launch_with_data(lambda x: dist.all_reduce(x, op="avg"), data):
        assert result.dtype == bfloat16
        np.testing.assert_allclose(
            result.astype(np.float32), data.astype(np.float32).mean(0), rtol=2e-2, atol=2e-2
        )


def test_bad_arguments_are_clear_errors():
    def bad(call):
        return lambda: call(np.arange(6.0).reshape(2, 3))

    with pytest.raises(ValueError, match="op='mean' is not one of"):
        dist.launch(bad(lambda x: dist.all_reduce(x, op="mean")), 2)
    with pytest.raises(TypeError, match="avg' needs a floating dtype"):
        dist.launch(lambda: dist.all_reduce(np.arange(3), op="avg"), 2)
    with pytest.raises(ValueError, match="not divisible by the group size 4"):
        dist.launch(bad(dist.reduce_scatter), 4)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        dist.launch(bad(lambda x: dist.all_gather(x, dim=2)), 2)
    with pytest.raises(ValueError, match="not part of"):
        dist.launch(bad(lambda x: dist.all_reduce(x, group=dist.new_group([0]))), 2)
    with pytest.raises(RuntimeError, match="outside a virtual rank"):
        dist.all_reduce(np.ones(2))


# --- the byte ledger ------------------------------------------------------------------------
def _records(devices, op):
    return [[r for r in d.comm.records if r.op == op] for d in devices]


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_bytes_follow_the_ring_formula(n):
    numel = 12 * n  # n divides the element count: every rank moves exactly 2(n-1)/n S
    data = per_rank_data(n, shape=(numel,), dtype=np.float32)
    S = numel * 4
    _, devices = dist.launch(lambda: dist.all_reduce(data[dist.get_rank()]), n, return_devices=True)
    for (record,) in _records(devices, "all_reduce"):
        assert record.sent_bytes == record.recv_bytes == 2 * (n - 1) * S // n
        assert record.group_kind == "other" and record.group_ranks == tuple(range(n))


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_bytes_with_uneven_chunks_sum_to_the_ring_total(n):
    numel = 5 * n + 1  # uneven chunks: per-rank figures differ, their sum does not
    data = per_rank_data(n, shape=(numel,), dtype=np.float64)
    S = numel * 8
    _, devices = dist.launch(lambda: dist.all_reduce(data[dist.get_rank()]), n, return_devices=True)
    assert sum(d.comm.sent_bytes for d in devices) == 2 * (n - 1) * S
    assert sum(d.comm.recv_bytes for d in devices) == 2 * (n - 1) * S


@pytest.mark.parametrize("n", SIZES)
def test_all_gather_and_reduce_scatter_bytes(n):
    piece = np.zeros((3, 5), dtype=np.float32)  # 60 bytes per rank; full tensor S = 60 n

    def worker():
        full = dist.all_gather(piece)
        dist.reduce_scatter(full)

    _, devices = dist.launch(worker, n, return_devices=True)
    S = 60 * n
    for d in devices:
        (gather,) = [r for r in d.comm.records if r.op == "all_gather"]
        (scatter,) = [r for r in d.comm.records if r.op == "reduce_scatter"]
        for record in (gather, scatter):
            assert record.sent_bytes == record.recv_bytes == (n - 1) * S // n


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_and_reduce_bytes(n):
    x = np.zeros(10, dtype=np.float64)  # S = 80 bytes
    src = 1

    def worker():
        dist.broadcast(x, src=src)
        dist.reduce(x, dst=src)

    _, devices = dist.launch(worker, n, return_devices=True)
    for op in ("broadcast", "reduce"):
        records = [r for (r,) in _records(devices, op)]
        # A chain: n-1 hops of S in total; the root only sends (broadcast) or only
        # receives (reduce); every rank sends and receives at most S.
        assert sum(r.sent_bytes for r in records) == (n - 1) * 80
        assert sum(r.recv_bytes for r in records) == (n - 1) * 80
        assert all(r.sent_bytes <= 80 and r.recv_bytes <= 80 for r in records)
    assert _records(devices, "broadcast")[src][0].recv_bytes == 0
    assert _records(devices, "broadcast")[src][0].sent_bytes == 80
    assert _records(devices, "reduce")[src][0].sent_bytes == 0
    assert _records(devices, "reduce")[src][0].recv_bytes == 80


def test_ledger_totals_by_op_group_phase_and_traffic_matrix():
    n = 4

    def worker():
        mesh = dist.DeviceMesh(dp=2, tp=2)
        with dist.phase("backward"):
            dist.all_reduce(np.zeros(8, np.float32), group=mesh.dp_group())
        with dist.phase("forward"):
            dist.all_gather(np.zeros(2, np.float32), group=mesh.tp_group())
        dist.barrier()

    _, devices = dist.launch(worker, n, return_devices=True)
    for d in devices:
        summary = d.summary()["comm"]
        assert summary["calls"] == 3
        assert summary["by_op"] == {"all_reduce": 32, "all_gather": 8, "barrier": 0}
        assert summary["by_group"] == {"dp": 32, "tp": 8, "pp": 0, "other": 0}
        assert summary["sent_bytes"] == 40 and summary["recv_bytes"] == 40
        assert [r.phase for r in d.comm.records] == ["backward", "forward", "other"]
    matrix = dist.traffic_matrix([d.comm for d in devices])
    # dp groups {0,2} {1,3}, tp groups {0,1} {2,3}: 32 bytes to the dp peer, 8 to the tp peer
    expected = np.array([[0, 8, 32, 0], [8, 0, 0, 32], [32, 0, 0, 8], [0, 32, 8, 0]])
    np.testing.assert_array_equal(matrix, expected)
    np.testing.assert_array_equal(matrix.sum(1), [d.comm.sent_bytes for d in devices])
    np.testing.assert_array_equal(matrix.sum(0), [d.comm.recv_bytes for d in devices])


def test_ring_traffic_goes_to_the_successor_only():
    n = 8
    _, devices = dist.launch(lambda: dist.all_reduce(np.zeros(64)), n, return_devices=True)
    matrix = dist.traffic_matrix([d.comm for d in devices])
    successor = np.roll(np.eye(n, dtype=np.int64), 1, axis=1)  # [i, i+1] = 1
    np.testing.assert_array_equal(matrix, successor * (2 * (n - 1) * 512 // n))


# --- determinism under shuffled thread timing ------------------------------------------------
def _program(seed_sleeps):
    """A mixed SPMD program; `seed_sleeps` None = no sleeps, else random tiny sleeps."""

    def worker(data):
        rank, device = dist.get_rank(), dist.get_device()
        jitter = None if seed_sleeps is None else random.Random(seed_sleeps * 100 + rank)

        def shuffle():
            if jitter is not None:
                time.sleep(jitter.random() * 2e-3)

        mesh = dist.DeviceMesh(dp=2, pp=2, tp=2)
        x = data[rank]
        out = []
        for step in range(3):
            shuffle()
            device.compute(1e9 * (rank + 1 + step), "forward")  # uneven arrival times
            out.append(dist.all_reduce(x * step, group=mesh.tp_group()))
            shuffle()
            out.append(dist.all_gather(x, group=mesh.dp_group()))
            shuffle()
            out.append(dist.reduce_scatter(x, group=mesh.dp_group()))
            shuffle()
            out.append(dist.all_reduce(x, op="avg"))
            peer = mesh.rank_at(**{**mesh.coords(), "pp": 1 - mesh.pp_rank})
            if mesh.pp_rank == 0:
                dist.send(x, peer, group=mesh.pp_group())
                out.append(dist.recv(peer, group=mesh.pp_group()))
            else:
                out.append(dist.recv(peer, group=mesh.pp_group()))
                shuffle()
                dist.send(x + 1, peer, group=mesh.pp_group())
        return out

    return worker


def _snapshot(results, devices):
    arrays = [[a.tobytes() for a in out] for out in results]
    ledgers = [d.comm.records for d in devices]
    clocks = [(d.clock.now, d.clock.summary(), d.clock.events) for d in devices]
    return arrays, ledgers, clocks


def test_bit_identical_results_and_ledgers_under_shuffled_timing(monkeypatch):
    data = per_rank_data(8, shape=(6, 5), dtype=np.float32, seed=7) * np.float32(1e3)
    reference = _snapshot(*dist.launch(_program(None), 8, data, return_devices=True))

    # Also shuffle inside the emulator: random sleeps before every rendezvous and post.
    jitter = random.Random(123)
    collective, post = Cluster.collective, Cluster.post

    def slow_collective(self, *args):
        time.sleep(jitter.random() * 1e-3)
        return collective(self, *args)

    def slow_post(self, *args):
        time.sleep(jitter.random() * 1e-3)
        return post(self, *args)

    monkeypatch.setattr(Cluster, "collective", slow_collective)
    monkeypatch.setattr(Cluster, "post", slow_post)
    for seed in range(3):
        shuffled = _snapshot(*dist.launch(_program(seed), 8, data, return_devices=True))
        assert shuffled[0] == reference[0]
        assert shuffled[1] == reference[1]
        assert shuffled[2] == reference[2]
