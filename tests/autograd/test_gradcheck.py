"""gradcheck itself must be able to fail."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd import Function, GradcheckError, gradcheck


class WrongSquare(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x  # should be 2 x


class RightSquare(WrongSquare):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * grad * x


def test_gradcheck_catches_a_wrong_backward():
    x = np.random.default_rng(0).standard_normal((3, 2))
    assert gradcheck(RightSquare.apply, [x])
    with pytest.raises(GradcheckError, match="input 0"):
        gradcheck(WrongSquare.apply, [x])


def test_gradcheck_passes_non_float_inputs_through():
    x = np.random.default_rng(0).standard_normal((4, 3))
    idx = np.array([2, 0])
    assert gradcheck(lambda t, i: t[i] * 3.0, [x, idx])
