"""Elementary differentiable ops: arithmetic with broadcasting, matmul, shapes, reductions.

Each op is a `Function` on ndarrays. Conventions shared by every op here:
- Broadcasting follows NumPy; backward sums a gradient back to its input's shape
  (`unbroadcast`).
- A `backward` never modifies the gradients it receives in place: the engine may hand the
  same array to several consumers.
- FLOPs: a matmul (M,K)@(K,N) costs 2*M*K*N forward and twice that backward (one matmul
  per input); elementwise ops count one FLOP per output element and operation (a few
  per element), reductions one per input element.
"""

from __future__ import annotations

import numpy as np

from minipar.autograd.function import Function
from minipar.autograd.kernels import gemm_kernel, linear_backward_kernels
from minipar.autograd.precision import add, bfloat16, float32, matmul, sum_to_dtype
from minipar.autograd.tensor import Tensor


def unbroadcast(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum `grad` over the axes NumPy broadcast to reach it from `shape`."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + i for i, n in enumerate(shape) if n == 1 and grad.shape[extra + i] != 1
    )
    return sum_to_dtype(grad, axis=axes, keepdims=True).reshape(shape)


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (np.shape(a), np.shape(b))
        out = add(a, b)
        ctx.flops_forward = ctx.flops_backward = out.size
        return out

    @staticmethod
    def backward(ctx, grad):
        need_a, need_b = ctx.needs_input_grad
        shape_a, shape_b = ctx.shapes
        return (unbroadcast(grad, shape_a) if need_a else None,
                unbroadcast(grad, shape_b) if need_b else None)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (np.shape(a), np.shape(b))
        out = np.subtract(a, b)
        ctx.flops_forward = ctx.flops_backward = out.size
        return out

    @staticmethod
    def backward(ctx, grad):
        need_a, need_b = ctx.needs_input_grad
        shape_a, shape_b = ctx.shapes
        return (unbroadcast(grad, shape_a) if need_a else None,
                unbroadcast(-grad, shape_b) if need_b else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        need_a, need_b = ctx.needs_input_grad
        ctx.save_for_backward(b if need_a else None, a if need_b else None)
        ctx.shapes = (np.shape(a), np.shape(b))
        out = np.multiply(a, b)
        ctx.flops_forward = out.size
        ctx.flops_backward = 2 * out.size
        return out

    @staticmethod
    def backward(ctx, grad):
        b, a = ctx.saved_tensors
        shape_a, shape_b = ctx.shapes
        return (None if b is None else unbroadcast(grad * b, shape_a),
                None if a is None else unbroadcast(grad * a, shape_b))


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        out = np.divide(a, b)
        ctx.save_for_backward(b, out if ctx.needs_input_grad[1] else None)
        ctx.shapes = (np.shape(a), np.shape(b))
        ctx.flops_forward = out.size
        ctx.flops_backward = 3 * out.size
        return out

    @staticmethod
    def backward(ctx, grad):
        b, out = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        shape_a, shape_b = ctx.shapes
        grad_a = grad / b
        # d(a/b)/db = -a/b^2 = -(a/b)/b
        return (unbroadcast(grad_a, shape_a) if need_a else None,
                unbroadcast(-grad_a * out, shape_b) if need_b else None)


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.flops_forward = ctx.flops_backward = a.size
        return np.negative(a)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Pow(Function):
    """x ** p for a constant exponent p."""

    @staticmethod
    def forward(ctx, x, exponent):
        ctx.save_for_backward(x)
        ctx.exponent = exponent
        ctx.flops_forward = x.size
        ctx.flops_backward = 3 * x.size
        return np.power(x, np.asarray(exponent, dtype=x.dtype))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        p = np.asarray(ctx.exponent, dtype=x.dtype)
        return grad * p * np.power(x, p - np.asarray(1, dtype=x.dtype)), None


class Exp(Function):
    @staticmethod
    def forward(ctx, x):
        out = np.exp(x)
        ctx.save_for_backward(out)
        ctx.flops_forward = ctx.flops_backward = x.size
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


class Log(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.flops_forward = ctx.flops_backward = x.size
        return np.log(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / x


class Tanh(Function):
    @staticmethod
    def forward(ctx, x):
        out = np.tanh(x)
        ctx.save_for_backward(out)
        ctx.flops_forward = x.size
        ctx.flops_backward = 3 * x.size
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        one = np.asarray(1, dtype=out.dtype)
        return grad * (one - out * out)


class MatMul(Function):
    """Batched `a @ b` (..., M, K) @ (..., K, N) with NumPy broadcasting of batch dims."""

    @staticmethod
    def forward(ctx, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(
                f"matmul needs arrays of at least 2 dims, got shapes {a.shape} and {b.shape}; "
                "reshape vectors to (1, K) or (K, 1)"
            )
        need_a, need_b = ctx.needs_input_grad
        ctx.save_for_backward(b if need_a else None, a if need_b else None)
        ctx.shapes = (a.shape, b.shape)
        out = matmul(a, b)
        flops = 2 * out.size * a.shape[-1]
        ctx.flops_forward = flops
        ctx.flops_backward = 2 * flops
        m, n = out.shape[-2:]
        batch = out.size // (m * n) if out.size else 0
        ctx.kernels_forward = (gemm_kernel(batch, m, n, a.shape[-1], out.dtype.itemsize),)
        ctx.kernels_backward = linear_backward_kernels(batch, m, n, a.shape[-1],
                                                       out.dtype.itemsize)
        return out

    @staticmethod
    def backward(ctx, grad):
        b, a = ctx.saved_tensors
        shape_a, shape_b = ctx.shapes
        grad_a = None if b is None else unbroadcast(matmul(grad, b.swapaxes(-1, -2)), shape_a)
        grad_b = None if a is None else unbroadcast(matmul(a.swapaxes(-1, -2), grad), shape_b)
        return grad_a, grad_b


class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.in_shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.in_shape), None


class Permute(Function):
    @staticmethod
    def forward(ctx, x, axes):
        ctx.axes = axes
        return x.transpose(axes)

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(np.argsort(ctx.axes)), None


def normalize_index(index):
    """An index with any Tensors replaced by their ndarrays."""
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return index


def _is_basic_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, np.integer, slice))
               for p in parts)


class GetItem(Function):
    """`x[index]`: basic slicing (a view) or advanced integer/boolean indexing (a copy)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.index = index
        ctx.in_shape = x.shape
        ctx.dtype = x.dtype
        ctx.basic = _is_basic_index(index)
        out = x[index]
        ctx.flops_backward = np.size(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Accumulate in fp32 for bf16; np.add.at handles repeated indices (scatter-add).
        work_dtype = float32 if ctx.dtype == bfloat16 else ctx.dtype
        full = np.zeros(ctx.in_shape, dtype=work_dtype)
        if ctx.basic:
            full[ctx.index] = grad
        else:
            np.add.at(full, ctx.index, grad.astype(work_dtype, copy=False))
        return full.astype(ctx.dtype, copy=False), None


class Sum(Function):
    """`scale * x.sum(axis, keepdims)`; `mean` is the sum scaled by 1/count."""

    @staticmethod
    def forward(ctx, x, axis, keepdims, scale):
        ctx.in_shape, ctx.axis, ctx.keepdims, ctx.scale = x.shape, axis, keepdims, scale
        work_dtype = float32 if x.dtype == bfloat16 else x.dtype
        out = np.asarray(x.sum(axis=axis, keepdims=keepdims, dtype=work_dtype))
        if scale != 1.0:
            out = out * np.asarray(scale, dtype=work_dtype)
        ctx.flops_forward = ctx.flops_backward = x.size
        return out.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        if ctx.scale != 1.0:
            grad = grad * np.asarray(ctx.scale, dtype=grad.dtype)
        if ctx.axis is not None and not ctx.keepdims:
            grad = np.expand_dims(grad, ctx.axis)
        return np.broadcast_to(grad, ctx.in_shape), None, None, None


class Split(Function):
    """Cut `x` along `axis` at `cuts`; the pieces are outputs of one node (views of x)."""

    @staticmethod
    def forward(ctx, x, cuts, axis):
        ctx.axis = axis
        return tuple(np.split(x, cuts, axis=axis))

    @staticmethod
    def backward(ctx, *grads):
        return np.concatenate(grads, axis=ctx.axis), None, None


class Concat(Function):
    @staticmethod
    def forward(ctx, axis, *arrays):
        ctx.axis = axis
        ctx.cuts = np.cumsum([a.shape[axis] for a in arrays])[:-1]
        return np.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        return (None, *np.split(grad, ctx.cuts, axis=ctx.axis))


def split(x: Tensor, split_size_or_sections, axis: int = -1) -> tuple[Tensor, ...]:
    """PyTorch `split`: an int gives the size of each piece, a list gives the sizes."""
    length = x.shape[axis]
    if isinstance(split_size_or_sections, (int, np.integer)):
        if split_size_or_sections <= 0:
            raise ValueError(f"split size must be positive, got {split_size_or_sections}")
        sizes = [split_size_or_sections] * (length // split_size_or_sections)
        if length % split_size_or_sections:
            sizes.append(length % split_size_or_sections)
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != length:
            raise ValueError(f"split sizes {sizes} do not add up to {length} (axis {axis})")
    return Split.apply(x, list(np.cumsum(sizes)[:-1]), axis)


def chunk(x: Tensor, chunks: int, axis: int = -1) -> tuple[Tensor, ...]:
    """`chunks` equal pieces along `axis` (the size must divide evenly)."""
    length = x.shape[axis]
    if chunks <= 0 or length % chunks:
        raise ValueError(f"cannot cut a dimension of {length} into {chunks} equal chunks")
    return split(x, length // chunks, axis)


def concat(tensors, axis: int = 0) -> Tensor:
    """Join tensors along `axis` (NumPy `concatenate`, PyTorch `cat`)."""
    return Concat.apply(axis, *tensors)
