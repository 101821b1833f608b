"""all_to_all: rank i gets chunk i of every rank's buffer. Values against NumPy, bytes
against the pairwise rule ((n-1)/n of the buffer out, as much in, one chunk to each
peer), time against the alpha-beta formula, and no hang on a wrong call."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist

SIZES = [2, 3, 4]


def _data(n, shape):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, *shape))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dim", [0, 1])
def test_rank_i_gets_chunk_i_of_every_rank(n, dim):
    data = _data(n, (2 * n, n))  # dim 0 and dim 1 both divisible by n
    results = dist.launch(lambda: dist.all_to_all(data[dist.get_rank()], dim=dim), n)
    for dst, result in enumerate(results):
        expected = np.concatenate(
            [np.split(data[src], n, axis=dim)[dst] for src in range(n)], axis=dim)
        np.testing.assert_array_equal(result, expected)
        assert result.shape == data[0].shape


def test_applied_twice_with_swapped_layout_it_is_the_identity():
    # The MoE combine undoes the dispatch: (src, dst) chunks transposed twice.
    n = 4
    data = _data(n, (8, 3))
    results = dist.launch(
        lambda: dist.all_to_all(dist.all_to_all(data[dist.get_rank()])), n)
    for rank in range(n):
        np.testing.assert_array_equal(results[rank], data[rank])


@pytest.mark.parametrize("n", SIZES)
def test_each_rank_sends_n_minus_one_chunks_one_to_each_peer(n):
    data = _data(n, (3 * n, 5))
    _, devices = dist.launch(lambda: dist.all_to_all(data[dist.get_rank()]), n,
                             return_devices=True)
    chunk = data[0].nbytes // n  # hand-computed: 3 rows x 5 fp64 per chunk
    assert chunk == 3 * 5 * 8
    for rank, device in enumerate(devices):
        (record,) = device.comm.records
        assert record.op == "all_to_all"
        assert record.sent_bytes == record.recv_bytes == (n - 1) * chunk
        assert dict(record.sent_to) == {p: chunk for p in range(n) if p != rank}
    matrix = dist.traffic_matrix([d.comm for d in devices])
    expected = np.full((n, n), chunk)
    np.fill_diagonal(expected, 0)
    np.testing.assert_array_equal(matrix, expected)


def test_time_is_pairwise_and_slower_across_nodes():
    n, shape = 4, (8, 1024)
    data = _data(n, shape)

    def clock_after(gpus_per_node):
        _, devices = dist.launch(lambda: dist.all_to_all(data[dist.get_rank()]), n,
                                 return_devices=True, gpus_per_node=gpus_per_node)
        return devices[0].clock.now

    inside, across = clock_after(4), clock_after(1)
    profile = dist.H100  # what launch simulates by default
    for same_node, measured in ((True, inside), (False, across)):
        alpha, bandwidth = profile.link(same_node)
        formula = (n - 1) * alpha + (n - 1) / n * data[0].nbytes / bandwidth
        assert measured == pytest.approx(formula, rel=1e-12)
    assert across > inside


def test_a_group_of_one_is_a_copy_and_moves_nothing():
    x = np.arange(6.0)
    (result,), (device,) = dist.launch(lambda: dist.all_to_all(x), 1, return_devices=True)
    np.testing.assert_array_equal(result, x)
    assert device.comm.calls == 0


def test_subgroup_and_bad_arguments():
    def worker():
        group = dist.new_group([0, 1] if dist.get_rank() < 2 else [2, 3])
        return dist.all_to_all(np.full(4, float(dist.get_rank())), group=group)

    results = dist.launch(worker, 4)
    np.testing.assert_array_equal(results[0], [0, 0, 1, 1])
    np.testing.assert_array_equal(results[3], [2, 2, 3, 3])
    with pytest.raises(ValueError, match="not divisible by the group size 2"):
        dist.launch(lambda: dist.all_to_all(np.zeros(3)), 2)


def _expect_fast(error, worker, n):
    """`error`, found where the ranks meet: not the watchdog's LaunchTimeoutError."""
    with pytest.raises(error) as info:
        dist.launch(worker, n, timeout=60)
    return str(info.value)


def test_mismatched_shapes_are_named_not_hung():
    def worker():
        return dist.all_to_all(np.zeros(4 if dist.get_rank() == 0 else 6))

    message = _expect_fast(dist.CollectiveMismatchError, worker, 2)
    assert "rank 0: all_to_all(shape=(4,)" in message
    assert "rank 1: all_to_all(shape=(6,)" in message


def test_a_rank_that_skips_it_is_a_deadlock_not_a_hang():
    def worker():
        if dist.get_rank() == 0:
            return dist.recv(1)
        return dist.all_to_all(np.zeros(2))

    message = _expect_fast(dist.DeadlockError, worker, 2)
    assert "all_to_all" in message

