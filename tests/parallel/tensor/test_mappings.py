"""f and g, the communication at the edges of a tensor-parallel region (mappings.py):
each op's forward and backward against NumPy, and the collectives it calls."""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.parallel.tensor.mappings import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
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
