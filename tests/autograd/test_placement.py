"""Placements of a rank's arrays: shard / unshard round trips, and a Partial() activation
that refuses to be used as a whole value until a reduction has summed it."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd import Function, Tensor
from minipar.autograd import functional as F
from minipar.autograd.placement import (
    Partial,
    PartialSum,
    PlacementError,
    Replicate,
    Shard,
    partial,
    require_reduced,
    require_replicated,
)


class Reduce(Function):
    """Stands in for g: takes the summand, returns a new (whole) Tensor."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


def summand():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    return x, partial(x * 1.0, "h.0.mlp.c_proj", "g (reduce_from_tensor_parallel_region)")


def test_a_partial_keeps_the_data_and_the_graph_and_its_reduction_is_whole():
    x, y = summand()
    assert isinstance(y, PartialSum) and y.placement == Partial()
    np.testing.assert_array_equal(y.data, x.data)
    z = Reduce.apply(y)
    assert type(z) is Tensor  # the reduction's output is an ordinary, whole value
    (z + 1.0).backward(np.ones((2, 3)))
    np.testing.assert_array_equal(x.grad, np.full((2, 3), 2.0))


@pytest.mark.parametrize("use, consumer", [
    (lambda y: y + 1.0, r"an addition \(\+, e\.g\. the bias or the residual\)"),
    (lambda y: Tensor(np.ones((2, 3))) + y, r"an addition"),
    (lambda y: y * 2.0, r"a multiplication"),
    (lambda y: y @ Tensor(np.ones((3, 3))), r"a matmul"),
    (lambda y: F.layer_norm(y, Tensor(np.ones(3)), Tensor(np.zeros(3))), r"layer_norm"),
    (lambda y: F.linear(y, Tensor(np.ones((3, 3)))), r"linear"),
    (lambda y: F.gelu(y), r"gelu"),
    (lambda y: F.cross_entropy(y, np.zeros(2, dtype=np.int64)), r"cross_entropy"),
])
def test_using_a_partial_as_a_whole_value_names_the_layer_and_the_missing_reduction(use,
                                                                                    consumer):
    _, y = summand()
    with pytest.raises(PlacementError, match=consumer + r".* got the output of h\.0\.mlp\.c_proj, "
                       r"which is Partial\(sum\).*the reduction g "
                       r"\(reduce_from_tensor_parallel_region\) over the tensor-parallel "
                       r"group is missing"):
        use(y)


def test_whole_values_pass_the_checks():
    require_reduced(Tensor(np.ones(3)), "layer_norm")
    require_reduced(np.ones(3), "layer_norm")
    require_replicated("ln_f.weight", Replicate())
    with pytest.raises(PlacementError, match=r"wte.weight is Shard\(0\) but must be "
                                             r"Replicate\(\) here"):
        require_replicated("wte.weight", Shard(0))
