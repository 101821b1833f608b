"""The communication at the edges of tensor- and sequence-parallel regions (mappings.py):
each op's forward and backward against NumPy, and the collectives it calls."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.parallel.tensor.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

B, T, D = 2, 8, 3


def launch_tp(fn, tp, *args):
    def rank(*a):
        group = dist.DeviceMesh(tp=tp).tp_group()
        return fn(group, dist.get_rank(group), *a)
    return dist.launch(rank, tp, *args, return_devices=True)


def piece(x, i, t):
    """Rank i's tokens along the sequence (dim 1)."""
    n = x.shape[1] // t
    return x[:, i * n:(i + 1) * n]


def ops(device):
    return [(r.phase, r.op) for r in device.comm.records]


# ---------------------------------------------------------------------------- f and g
def test_f_is_the_identity_forward_and_an_all_reduce_backward():
    def program(group, rank):
        x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
        y = copy_to_tensor_parallel_region(x, group)
        y.backward(np.full((2, 3), rank + 1.0))  # each rank's own gradient
        return y.data, x.grad
    results, _ = launch_tp(program, 4)
    for y, grad in results:
        np.testing.assert_array_equal(y, np.arange(6.0).reshape(2, 3))
        np.testing.assert_array_equal(grad, np.full((2, 3), 1.0 + 2 + 3 + 4))


def test_g_is_an_all_reduce_forward_and_the_identity_backward():
    def program(group, rank):
        x = Tensor(np.full(3, rank + 1.0), requires_grad=True)
        y = reduce_from_tensor_parallel_region(x, group)
        y.backward(np.array([1.0, 2.0, 3.0]))
        return y.data, x.grad
    results, _ = launch_tp(program, 4)
    for y, grad in results:
        np.testing.assert_array_equal(y, np.full(3, 10.0))
        np.testing.assert_array_equal(grad, [1.0, 2.0, 3.0])


# ---------------------------------------------------------------------------- SP regions
@pytest.mark.parametrize("tp", [2, 4])
def test_scatter_keeps_my_tokens_and_all_gathers_the_gradient(tp):
    x = np.random.default_rng(0).normal(size=(B, T, D))

    def program(group, rank):
        full = Tensor(x, requires_grad=True)
        mine = scatter_to_sequence_parallel_region(full, group)
        with dist.phase("backward"):
            mine.backward(np.full(mine.shape, rank + 1.0))
        return mine.data, full.grad

    results, devices = launch_tp(program, tp)
    expected_grad = np.concatenate([np.full((B, T // tp, D), i + 1.0) for i in range(tp)], 1)
    for i, (mine, grad) in enumerate(results):
        np.testing.assert_array_equal(mine, piece(x, i, tp))
        np.testing.assert_array_equal(grad, expected_grad)
        assert ops(devices[i]) == [("backward", "all_gather")]


@pytest.mark.parametrize("tp", [2, 4])
def test_gather_and_reduce_scatter_are_conjugates(tp):
    """g: all-gather forward, reduce-scatter backward; g-bar: the other way round."""
    rng = np.random.default_rng(1)
    pieces = rng.normal(size=(tp, B, T // tp, D))
    partials = rng.normal(size=(tp, B, T, D))
    upstream = rng.normal(size=(tp, B, T, D))

    def program(group, rank):
        x = Tensor(pieces[rank], requires_grad=True)
        gathered = gather_from_sequence_parallel_region(x, group)
        gathered.backward(upstream[rank])
        p = Tensor(partials[rank], requires_grad=True)
        reduced = reduce_scatter_to_sequence_parallel_region(p, group)
        reduced.backward(piece(upstream[rank], rank, tp))
        return gathered.data, x.grad, reduced.data, p.grad

    results, _ = launch_tp(program, tp)
    summed_upstream = upstream.sum(axis=0)
    sent_back = np.concatenate([piece(upstream[i], i, tp) for i in range(tp)], axis=1)
    for i, (gathered, x_grad, reduced, p_grad) in enumerate(results):
        np.testing.assert_array_equal(gathered, np.concatenate(list(pieces), axis=1))
        np.testing.assert_allclose(x_grad, piece(summed_upstream, i, tp), rtol=1e-14)
        np.testing.assert_allclose(reduced, piece(partials.sum(axis=0), i, tp), rtol=1e-14)
        np.testing.assert_array_equal(p_grad, sent_back)


def test_a_sequence_that_does_not_split_is_refused():
    def program(group, rank):
        scatter_to_sequence_parallel_region(Tensor(np.zeros((1, 6, 2))), group)
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by the "
                                         "tensor-parallel size 4"):
        launch_tp(program, 4)
