"""Data parallelism: flat buckets, gradient averaging once per step (no_sync), bucket
overlap on the simulated clock, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.nn import Parameter
from minipar.parallel.data.buckets import Bucket, build_buckets
from minipar.parallel.data.ddp import DataParallel
from minipar.parallel.state import bucket_pieces
from minipar.train import TrainConfig, train

SMALL = dict(seq_len=8, n_layer=2, d_model=16, n_head=2, micro_batch_size=2,
             precision="fp64", steps=1)
ADAMW = {"lr": 0.1, "betas": (0.9, 0.95), "weight_decay": 0.0}


def named(*shapes):
    return [(f"p{i}", Parameter(np.zeros(shape))) for i, shape in enumerate(shapes)]


# ------------------------------------------------------------------ layout
def test_bucket_lays_parameters_end_to_end_and_pads_to_the_shard_count():
    bucket = Bucket(0, named((2, 3), (4,), (5,)), shards=4)
    assert bucket.offsets == [0, 6, 10]
    assert (bucket.numel, bucket.padded_numel, bucket.shard_numel) == (15, 16, 4)
    assert bucket.padding == 1
    assert [bucket.shard_range(s) for s in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    # Shard 2 = flat [8, 12): the last 2 elements of p1 (its elements 2, 3) and the
    # first 2 of p2 (its elements 0, 1).
    assert list(bucket.overlaps(8, 12)) == [(1, 2, 4, 8, 10), (2, 0, 2, 10, 12)]
    flat = bucket.flatten([np.full((2, 3), 1.0), np.full(4, 2.0), np.full(5, 3.0)],
                          np.float64)
    np.testing.assert_array_equal(flat, [1] * 6 + [2] * 4 + [3] * 5 + [0])
    assert bucket.view(flat, 0).shape == (2, 3) and np.shares_memory(bucket.view(flat, 0), flat)
    pieces = bucket_pieces(bucket, "param", flat[8:12], shard=2)
    assert [(p.name, p.start, p.stop, list(p.values)) for p in pieces] == [
        ("p1", 2, 4, [2.0, 2.0]), ("p2", 0, 2, [3.0, 3.0])]


def test_buckets_follow_reverse_registration_order_and_their_capacity():
    params = named((4,), (4,), (16,), (2,))  # 32, 32, 128, 16 bytes
    buckets = build_buckets(params, bucket_bytes=64, shards=1)
    # reversed: p3 (16 B) + p2 (128 B) would exceed 64 B, so p2 gets its own bucket
    assert [b.names for b in buckets] == [["p3"], ["p2"], ["p1", "p0"]]
    (one,) = build_buckets(params, bucket_bytes=0, shards=1)
    assert one.names == ["p3", "p2", "p1", "p0"]


# ------------------------------------------------------------------ gradient averaging
def _linear_loss(params, coefficients):
    """sum_i (p_i * c_i).sum(): its gradient with respect to p_i is c_i."""
    total = None
    for p, c in zip(params, coefficients, strict=True):
        term = (p * c).sum()
        total = term if total is None else total + term
    return total


@pytest.mark.parametrize("bucket_bytes", [0, 40])
def test_gradients_are_averaged_once_per_step_after_all_micro_batches(bucket_bytes):
    n, accum = 3, 3
    shapes = [(2, 3), (4,), (5,)]
    rng = np.random.default_rng(0)
    coefficients = rng.standard_normal((n, accum, sum(int(np.prod(s)) for s in shapes)))

    def worker():
        rank = dist.get_rank()
        params = [p for _, p in named(*shapes)]
        engine = DataParallel(list(zip(["a", "b", "c"], params, strict=True)),
                              dist.new_group(range(n), "dp"), bucket_bytes=bucket_bytes,
                              adamw=ADAMW)
        calls = []
        for k in range(accum):
            engine.require_backward_grad_sync = k == accum - 1
            flat = coefficients[rank, k]
            parts = np.split(flat, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
            loss = _linear_loss(params, [c.reshape(s) for c, s in zip(parts, shapes,
                                                                      strict=True)])
            loss.backward()
            engine.finish_gradient_synchronization()
            calls.append(dist.get_device().comm.calls)
        return np.concatenate([p.grad.reshape(-1) for p in params]), calls, len(engine.buckets)

    results = dist.launch(worker, n)
    expected = coefficients.sum(axis=1).mean(axis=0)  # sum over micro-batches, mean over ranks
    for grads, calls, buckets in results:
        np.testing.assert_allclose(grads, expected, rtol=1e-12)
        # no communication before the last micro-batch, then one all-reduce per bucket
        assert calls == [0, 0, buckets]
    assert results[0][2] == (1 if bucket_bytes == 0 else 3)


def test_replicas_stay_identical_after_a_step():
    report = train(TrainConfig(dp=3, **{**SMALL, "steps": 2}))
    assert report.equivalence is None
    # the consolidation checks that every replica holds the same values, so a report
    # exists only if they do; and the weights moved
    assert all(np.isfinite(v).all() for v in report.state_dict.values())


# ------------------------------------------------------------------ bucket overlap
# A GPU 100,000x slower than an H100 makes this toy model's backward take longer than
# its all-reduce, as a real model's does; links without latency make the transfer time
# proportional to the bytes (per-call latency would dominate 1 KiB buckets: the reason
# DDP's default bucket is 25 MiB).
SLOW = dist.DeviceProfile(flops=4e9, intra_node_latency=0.0, inter_node_latency=0.0)


def test_small_buckets_overlap_the_all_reduce_with_backward():
    n = 4
    one = train(TrainConfig(dp=n, **SMALL), device=SLOW)
    many = train(TrainConfig(dp=n, bucket_size_mb=1e-3, **SMALL), device=SLOW)  # 1 KiB
    n_buckets = many.ranks[0]["sharding"]["buckets"]
    assert one.ranks[0]["sharding"]["buckets"] == 1 and n_buckets > 3
    assert many.ranks[0]["comm"]["calls"] == n_buckets
    # every gradient crosses the ring once either way: 2(n-1) x Psi x 8 bytes in total
    psi = many.n_params
    for report in (one, many):
        assert sum(r["comm"]["sent_bytes"] for r in report.ranks) == 2 * (n - 1) * psi * 8
    # One bucket waits its whole ring time after backward (alpha-beta formula; the
    # ranks arrive together); small buckets hide most of it behind backward.
    ring = dist.collective_time("all_reduce", n, psi * 8, 0.0, SLOW.intra_node_bandwidth)
    assert one.ranks[0]["time"]["comm_s"] == pytest.approx(ring)
    assert many.ranks[0]["time"]["comm_s"] < 0.5 * ring
    total = [r["time"]["compute_s"] + r["time"]["comm_s"] + r["time"]["idle_s"]
             for r in (one.ranks[0], many.ranks[0])]
    assert total[1] < total[0]
    np.testing.assert_array_equal(one.losses, many.losses)


def test_bucket_all_reduces_start_while_backward_is_still_computing():
    from minipar.nn import GPT, GPTConfig

    def worker():
        model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16))
        engine = DataParallel(model.named_parameters(), dist.new_group([0, 1], "dp"),
                              bucket_bytes=1024, adamw=ADAMW)
        idx = np.random.default_rng(dist.get_rank()).integers(0, 16, size=(2, 8))
        loss = model(idx, idx)
        with dist.phase("backward"):
            loss.backward()
            engine.finish_gradient_synchronization()
        device = dist.get_device()
        backward_end = max(e.end for e in device.clock.events if e.kind == "backward")
        return [r.start for r in device.comm.records], backward_end, len(engine.buckets)

    for starts, backward_end, buckets in dist.launch(worker, 2, device=SLOW):
        assert len(starts) == buckets > 3
        # all but the last bucket (wte, finished by the very last backward op) ran
        # during backward
        assert sum(start < backward_end for start in starts) > buckets // 2


def test_a_parameter_without_gradient_is_a_clear_error():
    def worker():
        used, unused = Parameter(np.ones(3)), Parameter(np.ones(2))
        engine = DataParallel([("used", used), ("unused", unused)],
                              dist.new_group([0, 1], "dp"), adamw=ADAMW)
        (used * 2.0).sum().backward()
        engine.finish_gradient_synchronization()

    with pytest.raises(RuntimeError, match="only 1 of the 2 parameters .* got a gradient"):
        dist.launch(worker, 2)
