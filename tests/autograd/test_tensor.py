"""The engine: gradient accumulation over shared subgraphs, leaf hooks, graph lifetime,
deep graphs without recursion limits, and the Tensor API."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd import Tensor


def test_diamond_graph_sums_both_paths():
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    y = x * x + x * 3.0  # dy/dx = 2x + 3
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, 2 * x.data + 3)


def test_shared_intermediate_used_by_many_consumers():
    x = Tensor(np.array([0.5, -1.0]), requires_grad=True)
    h = x.tanh()
    (h * h + h + h * 2.0).sum().backward()  # d/dx = (2h + 3)(1 - h^2)
    h_value = np.tanh(x.data)
    np.testing.assert_allclose(x.grad, (2 * h_value + 3) * (1 - h_value**2))


def test_backward_accumulates_across_calls():
    x = Tensor(np.ones(2), requires_grad=True)
    (x * 2.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad, [5.0, 5.0])


def test_leaf_grad_is_not_aliased_between_leaves():
    a = Tensor(np.ones(2), requires_grad=True)
    b = Tensor(np.ones(2), requires_grad=True)
    (a + b).sum().backward()  # Add hands the same gradient to both
    a.grad += 10
    np.testing.assert_array_equal(b.grad, [1.0, 1.0])


def test_deep_chain_has_no_recursion_limit():
    x = Tensor(np.array([1.0]), requires_grad=True)
    y = x
    for _ in range(20000):
        y = y * 1.0
    y.sum().backward()
    assert x.grad[0] == 1.0


def test_backward_twice_raises_a_clear_error():
    x = Tensor(np.ones(3), requires_grad=True)
    loss = (x * x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="already freed"):
        loss.backward()


def test_backward_needs_a_scalar_or_a_grad():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="one-element"):
        (x * 2.0).backward()
    (x * 2.0).backward(np.array([1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(x.grad, [2.0, 0.0, 4.0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(1)).backward()


def test_post_accumulate_hook_fires_once_with_the_complete_gradient():
    w = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    v = Tensor(np.array([3.0, 4.0]), requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda t: seen.append(("w", t.grad.copy())))
    v.register_post_accumulate_grad_hook(lambda t: seen.append(("v", t.grad.copy())))
    # w is used three times (like a tied embedding used twice and more)
    loss = (w * v).sum() + (w * 2.0).sum() + (w.reshape(1, 2) @ Tensor(np.ones((2, 1)))).sum()
    loss.backward()
    assert sorted(name for name, _ in seen) == ["v", "w"]
    w_grad = dict(seen)["w"]
    np.testing.assert_array_equal(w_grad, v.data + 2.0 + 1.0)
    handle = w.register_post_accumulate_grad_hook(lambda t: seen.append(("again", None)))
    handle.remove()
    (w * 1.0).sum().backward()
    assert [name for name, _ in seen].count("again") == 0
    assert [name for name, _ in seen].count("w") == 2


def test_hook_only_on_leaves_that_require_grad():
    x = Tensor(np.ones(2), requires_grad=True)
    with pytest.raises(RuntimeError, match="leaves"):
        (x * 2.0).register_post_accumulate_grad_hook(lambda t: None)


def test_detach_and_item():
    x = Tensor(np.array([2.0]), requires_grad=True)
    d = (x * 3.0).detach()
    assert not d.requires_grad and d.is_leaf and d.item() == 6.0


def test_only_float_tensors_require_grad():
    with pytest.raises(TypeError, match="floating"):
        Tensor(np.arange(3), requires_grad=True)


def test_ndarray_on_the_left_calls_tensor_ops():
    x = Tensor(np.ones((2, 2)), requires_grad=True)
    y = np.full((2, 2), 3.0) * x + np.ones((2, 2))
    assert isinstance(y, Tensor)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, np.full((2, 2), 3.0))


def test_properties():
    t = Tensor(np.zeros((2, 3), dtype=np.float32))
    assert t.shape == (2, 3) and t.ndim == 2 and t.dtype == np.float32 and len(t) == 2
