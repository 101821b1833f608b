"""The Function extension API and what the engine reports to the current device:
FLOPs, activations held from save to backward, parameters kept by reference, grads."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd import Function, Tensor, no_grad
from minipar.autograd import functional as F


class Scale(Function):
    """y = w * x; a parameter w and an activation x."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.flops_forward = x.size
        ctx.flops_backward = 2 * x.size
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(keepdims=True).reshape(w.shape)


def test_flops_are_reported_per_call(device):
    x = Tensor(np.ones((4, 5)), requires_grad=True)
    w = Tensor(np.ones(1), requires_grad=True)
    Scale.apply(x, w).sum().backward()
    assert device.flops["forward"] == 20 + 20  # Scale + Sum (one per element)
    assert device.flops["backward"] == 40 + 20


def test_matmul_flops_convention(device):
    a = Tensor(np.ones((2, 3, 4)), requires_grad=True)
    b = Tensor(np.ones((4, 5)), requires_grad=True)
    y = a @ b
    assert device.flops["forward"] == 2 * 2 * 3 * 4 * 5
    y.backward(np.ones(y.shape))
    assert device.flops["backward"] == 2 * device.flops["forward"]


def test_activations_held_until_backward_then_released(device):
    x = Tensor(np.ones((100, 10)), requires_grad=True)
    w = Tensor(np.ones(1), requires_grad=True)
    h = x * 3.0  # an activation (not a leaf)
    assert device.memory.current["activations"] == 8  # Mul saved the 0-d constant 3.0
    y = Scale.apply(h, w)
    # Scale saved h (8000 bytes) but not the parameter w
    assert device.memory.current["activations"] == 8 + 8000
    y.sum().backward()
    assert device.memory.current["activations"] == 0
    assert device.memory.peak["activations"] == 8008
    # grads of the two leaves are held as "grads"
    assert device.memory.current["grads"] == x.grad.nbytes + w.grad.nbytes


def test_parameters_are_saved_by_reference_and_read_at_backward_time(device):
    # ZeRO-3 frees a gathered weight after forward and gathers it again before backward.
    x = Tensor(np.full((2, 3), 2.0), requires_grad=True)
    weight = Tensor(np.ones((3, 4)), requires_grad=True)
    y = F.linear(x, weight)
    assert device.memory.current["activations"] == 0  # x is a leaf too: not saved
    weight.data = np.full((3, 4), 5.0)  # "re-gathered" into a new buffer
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, np.full((2, 3), 20.0))  # used the new data


def test_nothing_is_held_without_a_graph(device):
    x = Tensor(np.ones((10, 10)), requires_grad=True)
    with no_grad():
        F.gelu(x)
    F.gelu(Tensor(np.ones((10, 10))))  # no input requires grad
    assert device.memory.peak["activations"] == 0
    assert device.flops["forward"] == 2 * 8 * 100


def test_dropped_graph_releases_its_activations(device):
    x = Tensor(np.ones((10, 10)), requires_grad=True)
    y = F.gelu(x * 2.0)
    assert device.memory.current["activations"] > 0
    del y
    assert device.memory.current["activations"] == 0


def test_zero_grad_style_release(device):
    w = Tensor(np.ones(3), requires_grad=True)
    (w * 2.0).sum().backward()
    assert device.memory.current["grads"] == 24
    (w * 2.0).sum().backward()  # accumulating does not hold again
    assert device.memory.current["grads"] == 24
    w.release_grad()
    assert w.grad is None and device.memory.current["grads"] == 0


class TwoOutputs(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return 2 * grad_a + 3 * grad_b


def test_multiple_outputs_and_unused_outputs():
    x = Tensor(np.ones(3), requires_grad=True)
    a, b = TwoOutputs.apply(x)
    (a * b).sum().backward()  # d/dx (6 x^2) = 12 x
    np.testing.assert_array_equal(x.grad, np.full(3, 12.0))
    x.grad = None
    a, _ = TwoOutputs.apply(x)
    a.sum().backward()  # the unused output receives zeros
    np.testing.assert_array_equal(x.grad, np.full(3, 2.0))


class WrongCount(Function):
    @staticmethod
    def forward(ctx, x, y):
        return x + y

    @staticmethod
    def backward(ctx, grad):
        return grad


class WrongShape(Function):
    @staticmethod
    def forward(ctx, x):
        return x.sum(keepdims=True)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_backward_contract_violations_are_named():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="WrongCount.backward returned 1 gradients for 2"):
        WrongCount.apply(x, x).sum().backward()
    with pytest.raises(RuntimeError, match=r"WrongShape.backward returned a gradient of shape"):
        WrongShape.apply(x).sum().backward()


def test_non_tensor_arguments_pass_through():
    class AddConstant(Function):
        @staticmethod
        def forward(ctx, x, c):
            assert isinstance(c, float)
            return x + c

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    x = Tensor(np.zeros(2), requires_grad=True)
    AddConstant.apply(x, 1.5).sum().backward()
    np.testing.assert_array_equal(x.grad, [1.0, 1.0])
