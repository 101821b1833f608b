"""The ring on send/recv moves exactly the bytes all_reduce / all_gather / reduce_scatter
book: proof that the byte ledger counts real traffic, not a formula."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist

SIZES = [2, 3, 4, 8]


def per_rank_sends(devices, ops):
    return [
        (
            sum(r.sent_bytes for r in d.comm.records if r.op in ops),
            sum(r.recv_bytes for r in d.comm.records if r.op in ops),
        )
        for d in devices
    ]


def compare(n, numel, builtin, ring, dtype=np.float64):
    data = np.random.default_rng(n).standard_normal((n, numel)).astype(dtype)
    run = lambda f: dist.launch(lambda: f(data[dist.get_rank()]), n, return_devices=True)  # noqa: E731
    builtin_results, builtin_devices = run(builtin)
    ring_results, ring_devices = run(ring)
    for a, b in zip(builtin_results, ring_results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    assert per_rank_sends(builtin_devices, {"all_reduce", "all_gather", "reduce_scatter"}) == (
        per_rank_sends(ring_devices, {"send", "recv"})
    )
    builtin_matrix = dist.traffic_matrix([d.comm for d in builtin_devices])
    np.testing.assert_array_equal(
        builtin_matrix, dist.traffic_matrix([d.comm for d in ring_devices])
    )
    return builtin_devices, ring_devices


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("extra", [0, 1, 3])  # uneven chunks too: per-rank bytes differ
def test_ring_all_reduce_books_what_all_reduce_books(n, extra):
    builtin, ring = compare(n, 4 * n + extra, dist.all_reduce, dist.ring_all_reduce)
    if extra == 0:
        # Same simulated time as well: 2(n-1) steps of alpha + (S/n)/B on one node.
        for a, b in zip(builtin, ring, strict=True):
            assert b.clock.now == pytest.approx(a.clock.now, rel=1e-12)
            assert b.clock.comm_s == pytest.approx(a.clock.comm_s, rel=1e-12)


@pytest.mark.parametrize("n", SIZES)
def test_ring_all_gather_and_reduce_scatter(n):
    compare(n, 3, dist.all_gather, dist.ring_all_gather)
    compare(n, 2 * n, dist.reduce_scatter, dist.ring_reduce_scatter)


def test_ring_all_reduce_avg_and_max():
    compare(4, 9, lambda x: dist.all_reduce(x, op="avg"), lambda x: dist.ring_all_reduce(x, "avg"))
    compare(3, 7, lambda x: dist.all_reduce(x, op="max"), lambda x: dist.ring_all_reduce(x, "max"))
