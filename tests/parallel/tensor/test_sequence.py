"""Sequence parallelism's regions and column-parallel linear layer, checked against
NumPy: values, gradients, the collectives they call and what the layer keeps for
backward."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.parallel.tensor.sequence import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    sequence_parallel_linear,
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



@pytest.mark.parametrize("transpose_weight", [False, True])
def test_sequence_parallel_linear_is_the_linear_of_the_gathered_input(transpose_weight):
    """y_i = all_gather(x) @ W_i + b_i with W split by columns; its gradients equal the
    NumPy chain rule, and it keeps only my (B, T/t, in) tokens for backward."""
    tp, d_in, d_out = 2, 4, 6
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, T, d_in))
    weight, bias = rng.normal(size=(d_in, d_out)), rng.normal(size=d_out)
    upstream = rng.normal(size=(B, T, d_out))  # columns of rank i: its slice
    cols = d_out // tp

    def program(group, rank):
        w = weight[:, rank * cols:(rank + 1) * cols]
        stored = w.T.copy() if transpose_weight else w.copy()
        w_t = Tensor(stored, requires_grad=True)
        b_t = None if transpose_weight else Tensor(bias[rank * cols:(rank + 1) * cols],
                                                   requires_grad=True)
        x_t = Tensor(piece(x, rank, tp).copy(), requires_grad=True)
        device = dist.get_device()
        with dist.phase("forward"):
            # An activation, not a leaf (a leaf would be kept by reference, like a weight).
            x_in = x_t.reshape(x_t.shape)
            y = sequence_parallel_linear(x_in, w_t, b_t, group, transpose_weight)
        saved = device.memory.current["activations"]
        with dist.phase("backward"):
            y.backward(upstream[..., rank * cols:(rank + 1) * cols])
        return (y.data, x_t.grad, w_t.grad, None if b_t is None else b_t.grad, saved,
                device.memory.peak["buffers"])

    results, devices = launch_tp(program, tp)
    grad_x = upstream @ weight.T
    flat_x, flat_up = x.reshape(-1, d_in), upstream.reshape(-1, d_out)
    for i, (y, gx, gw, gb, saved, buffers) in enumerate(results):
        mine = slice(i * cols, (i + 1) * cols)
        expected_y = x @ weight[:, mine] + (0 if transpose_weight else bias[mine])
        np.testing.assert_allclose(y, expected_y, rtol=1e-13)
        np.testing.assert_allclose(gx, piece(grad_x, i, tp), rtol=1e-13)
        expected_gw = flat_x.T @ flat_up[:, mine]
        np.testing.assert_allclose(gw, expected_gw.T if transpose_weight else expected_gw,
                                   rtol=1e-13)
        if not transpose_weight:
            np.testing.assert_allclose(gb, flat_up[:, mine].sum(0), rtol=1e-13)
        assert saved == B * (T // tp) * d_in * 8  # my tokens only, not the gathered input
        assert buffers == B * T * d_in * 8  # the re-gathered input, while dW is formed
        # forward: gather; backward: gather again (for dW), reduce-scatter dx
        assert ops(devices[i]) == [("forward", "all_gather"), ("backward", "all_gather"),
                                   ("backward", "reduce_scatter")]
