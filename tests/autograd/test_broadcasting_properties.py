"""Property: for any pair of broadcast-compatible shapes, backward un-broadcasts exactly.

d/da sum(a * b) is b summed over the axes along which a was broadcast; hypothesis draws
the shapes (including size-1 and missing leading axes)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from minipar.autograd import Tensor


def reduce_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum `grad` down to `shape` the way broadcasting expanded it (independent of the engine)."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


@settings(max_examples=60, deadline=None)
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=3),
       op=st.sampled_from(["add", "mul", "sub", "div"]))
def test_backward_unbroadcasts_to_each_input_shape(shapes, op):
    rng = np.random.default_rng(0)
    a_shape, b_shape = shapes.input_shapes
    a_data = rng.uniform(1.0, 2.0, a_shape)
    b_data = rng.uniform(1.0, 2.0, b_shape)
    a, b = Tensor(a_data, requires_grad=True), Tensor(b_data, requires_grad=True)
    out = {"add": a + b, "mul": a * b, "sub": a - b, "div": a / b}[op]
    out.sum().backward()
    full = np.ones(shapes.result_shape)
    local_a = {"add": full, "mul": full * b_data, "sub": full, "div": full / b_data}[op]
    local_b = {"add": full, "mul": full * a_data, "sub": -full,
               "div": -full * a_data / b_data**2}[op]
    np.testing.assert_allclose(a.grad, reduce_to(local_a, a_shape), rtol=1e-12)
    np.testing.assert_allclose(b.grad, reduce_to(local_b, b_shape), rtol=1e-12)
    assert a.grad.shape == a_shape and b.grad.shape == b_shape
