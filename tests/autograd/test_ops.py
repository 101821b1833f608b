"""Every elementary op: forward equals NumPy, backward equals finite differences (fp64),
over varied shapes including broadcasting and batch dimensions."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd import Tensor, concat, gradcheck

rng = np.random.default_rng(1234)


def randn(*shape):
    return rng.standard_normal(shape)


BROADCAST_PAIRS = [
    ((3, 4), (3, 4)),
    ((2, 3, 4), (4,)),
    ((2, 1, 4), (3, 1)),
    ((4,), (2, 3, 4)),
    ((2, 3), ()),
]


@pytest.mark.parametrize("shape_a, shape_b", BROADCAST_PAIRS)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_ops_match_numpy_and_finite_differences(op, shape_a, shape_b):
    a = randn(*shape_a)
    b = randn(*shape_b)
    if op == "div":  # keep the denominator away from zero
        b = np.sign(b) * (1.0 + np.abs(b))
    fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y,
          "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[op]
    out = fn(Tensor(a), Tensor(b))
    np.testing.assert_allclose(out.data, fn(a, b), rtol=1e-15)
    assert gradcheck(fn, [a, b])


def test_scalar_and_ndarray_operands():
    a = randn(2, 3)
    assert gradcheck(lambda x: 2.0 * x - 1.0 + x / 3.0 - 1.0 / (x * x + 1.0), [a])
    constant = randn(3)
    assert gradcheck(lambda x: constant * x + constant - x, [a])


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 3, 4)])
def test_unary_ops(shape):
    x = randn(*shape)
    positive = np.abs(x) + 0.5
    assert gradcheck(lambda t: -t, [x])
    assert gradcheck(lambda t: t.exp(), [x])
    assert gradcheck(lambda t: t.log(), [positive])
    assert gradcheck(lambda t: t.tanh(), [x])
    assert gradcheck(lambda t: t ** 3, [x])
    assert gradcheck(lambda t: t ** 0.5, [positive])
    np.testing.assert_allclose((Tensor(positive) ** 0.5).data, np.sqrt(positive))


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (3, 4, 2)),
    ((1, 4), (4, 1)),
]


@pytest.mark.parametrize("shape_a, shape_b", MATMUL_SHAPES)
def test_matmul(shape_a, shape_b):
    a, b = randn(*shape_a), randn(*shape_b)
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).data, np.matmul(a, b), rtol=1e-13)
    assert gradcheck(lambda x, y: x @ y, [a, b])


def test_matmul_rejects_vectors():
    with pytest.raises(ValueError, match="at least 2 dims"):
        Tensor(randn(3)) @ Tensor(randn(3, 2))


def test_shape_ops():
    x = randn(2, 3, 4)
    assert gradcheck(lambda t: t.reshape(6, 4), [x])
    assert gradcheck(lambda t: t.reshape(-1), [x])
    assert gradcheck(lambda t: t.permute(2, 0, 1), [x])
    assert gradcheck(lambda t: t.transpose(0, 2), [x])
    assert gradcheck(lambda t: t.T, [x])


def test_transpose_semantics():
    x = randn(2, 3, 4)
    t = Tensor(x)
    assert t.transpose(1, 2).shape == (2, 4, 3)  # PyTorch: swap two dims
    assert t.transpose().shape == (4, 3, 2)  # NumPy: reverse
    assert t.transpose(2, 0, 1).shape == (4, 2, 3)  # full permutation
    np.testing.assert_array_equal(t.transpose(0, 2).data, np.swapaxes(x, 0, 2))


MASK = np.array([[True, False, True, True], [False, True, False, True], [True] * 4])


@pytest.mark.parametrize("shape, index", [
    ((2, 3, 4), (slice(None), 1)),
    ((2, 3, 4), (Ellipsis, slice(1, 3))),
    ((2, 3, 4), 0),
    ((2, 3), np.array([0, 1, 0, 0])),  # repeated rows: gradients must add up
    ((2, 3, 4), (slice(None), np.array([2, 2, 0]))),
    ((2, 3, 4), (slice(None), MASK)),
])
def test_getitem(shape, index):
    x = randn(*shape)
    np.testing.assert_array_equal(Tensor(x)[index].data, x[index])
    assert gradcheck(lambda t: t[index], [x])


def test_getitem_repeated_indices_scatter_add():
    x = Tensor(np.zeros((3, 2)), requires_grad=True)
    x[np.array([1, 1, 1, 2])].sum().backward()
    np.testing.assert_array_equal(x.grad, [[0, 0], [3, 3], [1, 1]])


@pytest.mark.parametrize("axis, keepdims", [(None, False), (0, False), (1, True),
                                            ((0, 2), False), (-1, True)])
def test_sum_and_mean(axis, keepdims):
    x = randn(2, 3, 4)
    np.testing.assert_allclose(Tensor(x).sum(axis, keepdims).data, x.sum(axis=axis,
                               keepdims=keepdims))
    np.testing.assert_allclose(Tensor(x).mean(axis, keepdims).data, x.mean(axis=axis,
                               keepdims=keepdims))
    assert gradcheck(lambda t: t.sum(axis, keepdims), [x])
    assert gradcheck(lambda t: t.mean(axis, keepdims), [x])


def test_split_chunk_concat():
    x = randn(2, 7, 3)
    pieces = Tensor(x).split([2, 4, 1], axis=1)
    assert [p.shape for p in pieces] == [(2, 2, 3), (2, 4, 3), (2, 1, 3)]
    assert [p.shape for p in Tensor(x).split(3, axis=1)] == [(2, 3, 3), (2, 3, 3), (2, 1, 3)]
    assert gradcheck(lambda t: t.split([2, 4, 1], axis=1), [x])
    # unused pieces receive zero gradient
    assert gradcheck(lambda t: t.split([2, 4, 1], axis=1)[1] * 2.0, [x])
    assert gradcheck(lambda t: t.chunk(3, axis=-1)[0] + t.chunk(3, axis=-1)[2], [x])
    y = randn(2, 2, 3)
    np.testing.assert_array_equal(concat([Tensor(x), Tensor(y)], axis=1).data,
                                  np.concatenate([x, y], axis=1))
    assert gradcheck(lambda a, b: concat([a, b, a], axis=1), [x, y])
    with pytest.raises(ValueError, match="add up"):
        Tensor(x).split([2, 2], axis=1)
    with pytest.raises(ValueError, match="equal chunks"):
        Tensor(x).chunk(2, axis=1)


def test_composite_expression_with_reuse():
    x, w = randn(4, 3), randn(3, 3)
    assert gradcheck(lambda a, b: ((a @ b).tanh() * a + a).sum(axis=0) / 2.0, [x, w])
