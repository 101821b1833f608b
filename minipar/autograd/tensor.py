"""`Tensor`: an ndarray plus what reverse-mode autograd needs, and its operators.

A `Tensor` wraps an ndarray (`.data`) and, once `backward()` has run, its gradient
(`.grad`). Every differentiable op is a `Function` with a `forward` and a `backward`
written on plain ndarrays, in the shape of PyTorch's extension API
(https://pytorch.org/docs/stable/notes/extending.html):

    class Square(Function):
        @staticmethod
        def forward(ctx, x):                  # x: ndarray (a Tensor arrives as its .data)
            ctx.save_for_backward(x)
            ctx.flops_forward = x.size        # FLOPs of this call, reported to the device
            ctx.flops_backward = 2 * x.size
            return x * x
        @staticmethod
        def backward(ctx, grad_out):          # one gradient per forward argument
            (x,) = ctx.saved_tensors
            return 2 * x * grad_out

    y = Square.apply(t)                       # a Tensor, recorded in the graph

The engine is three files, one idea each:
    tensor.py     Tensor: data, grad, requires_grad, its operators (+ - * / @ ** [])
                  and methods, leaf gradient hooks
    function.py   Function.apply and Context: a call's graph node, what its forward saved
                  for backward, the FLOPs and activation memory it reports
    engine.py     run_backward: the reverse-mode walk over the graph and the accumulation
                  of finished gradients into leaves (where the hooks fire)
The ops themselves are in ops.py (elementary) and functional.py (fused).

Imports: Tensor's operators make op calls and Function.apply makes Tensors, a cycle. So
tensor.py imports ops, engine and function at its end, once `Tensor` is defined, and
function.py imports tensor at its end, once `Function` is: whichever is imported first,
each class exists before the other module reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # function.py imports this module: the name is for annotations only
    from minipar.autograd.function import Context

__all__ = ["Tensor"]


class Tensor:
    """An ndarray plus what reverse-mode autograd needs.

    Attributes: `data` (ndarray), `grad` (ndarray or None, same shape and dtype as data),
    `requires_grad`. A tensor made by an op while recording remembers its node (`_ctx`)
    and which of the node's outputs it is (`_index`); leaves have `_ctx = None`.
    """

    __slots__ = (
        "data",
        "grad",
        "requires_grad",
        "_ctx",
        "_index",
        "_post_accumulate_grad_hooks",
        "_grad_device",
        "__weakref__",
    )
    # `ndarray + Tensor` must call Tensor.__radd__ instead of looping over the array.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad: bool = False):
        if isinstance(data, Tensor):
            data = data.data
        data = np.asarray(data)
        if requires_grad and data.dtype.kind not in "fcV":
            raise TypeError(
                f"only floating-point tensors can require grad, got dtype {data.dtype}"
            )
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._ctx = None
        self._index = 0
        self._post_accumulate_grad_hooks = None
        self._grad_device = None

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def item(self) -> float:
        return self.data.item()

    def numpy(self) -> np.ndarray:
        return self.data

    def detach(self) -> Tensor:
        """A new leaf sharing `data`, cut from the graph."""
        return Tensor(self.data)

    # ------------------------------------------------------------------ gradients
    def backward(self, grad=None) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's `.grad` (reverse mode).

        `grad` is the gradient of some scalar with respect to this tensor; it may be
        omitted only when this tensor holds one element (a loss).
        """
        if not self.requires_grad:
            raise RuntimeError(
                "backward() on a tensor that does not require grad: no input of the ops "
                "that made it requires grad, or it was computed under no_grad()"
            )
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(
                    f"backward() without a grad needs a one-element tensor, got shape "
                    f"{self.shape}; pass grad=... of that shape"
                )
            grad = np.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else np.asarray(grad)
            if grad.shape != self.shape:
                raise ValueError(f"grad has shape {grad.shape}, tensor has {self.shape}")
        engine.run_backward(self, grad)

    def register_post_accumulate_grad_hook(self, hook) -> _HookHandle:
        """Call `hook(self)` once this leaf's gradient of a backward pass is complete.

        "Complete" means every use of the leaf in the graph has contributed, so a tied
        embedding used twice fires once. Data-parallel gradient buckets and ZeRO-2 use
        this to start reducing gradients while backward is still running (as
        `torch.Tensor.register_post_accumulate_grad_hook`).
        """
        if self._ctx is not None or not self.requires_grad:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaves "
                               "that require grad (parameters)")
        if self._post_accumulate_grad_hooks is None:
            self._post_accumulate_grad_hooks = []
        self._post_accumulate_grad_hooks.append(hook)
        return _HookHandle(self._post_accumulate_grad_hooks, hook)

    def release_grad(self) -> None:
        """Drop `.grad` and release it from the ledger that holds it (if any)."""
        if self.grad is not None and self._grad_device is not None:
            self._grad_device.memory.release(self.grad)
        self.grad = None
        self._grad_device = None

    # ------------------------------------------------------------------ operators
    def __add__(self, other):
        return ops.Add.apply(self, _operand(other, self))

    def __radd__(self, other):
        return ops.Add.apply(_operand(other, self), self)

    def __sub__(self, other):
        return ops.Sub.apply(self, _operand(other, self))

    def __rsub__(self, other):
        return ops.Sub.apply(_operand(other, self), self)

    def __mul__(self, other):
        return ops.Mul.apply(self, _operand(other, self))

    def __rmul__(self, other):
        return ops.Mul.apply(_operand(other, self), self)

    def __truediv__(self, other):
        return ops.Div.apply(self, _operand(other, self))

    def __rtruediv__(self, other):
        return ops.Div.apply(_operand(other, self), self)

    def __neg__(self):
        return ops.Neg.apply(self)

    def __matmul__(self, other):
        return ops.MatMul.apply(self, _operand(other, self))

    def __rmatmul__(self, other):
        return ops.MatMul.apply(_operand(other, self), self)

    def __pow__(self, exponent: float):
        return ops.Pow.apply(self, float(exponent))

    def __getitem__(self, index):
        return ops.GetItem.apply(self, ops.normalize_index(index))

    # ------------------------------------------------------------------ methods
    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return ops.Reshape.apply(self, shape)

    def view(self, *shape):
        return self.reshape(*shape)

    def permute(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return ops.Permute.apply(self, tuple(axes))

    def transpose(self, *axes):
        """`t.transpose(d0, d1)` swaps two dims (PyTorch); `t.transpose()` reverses them
        all (NumPy `.T`); a full permutation `t.transpose(2, 0, 1)` is also accepted."""
        ndim = self.data.ndim
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        if not axes:
            perm = tuple(range(ndim - 1, -1, -1))
        elif len(axes) == 2 and ndim != 2:
            perm = list(range(ndim))
            d0, d1 = (a % ndim for a in axes)
            perm[d0], perm[d1] = perm[d1], perm[d0]
            perm = tuple(perm)
        else:
            perm = tuple(axes)
        return ops.Permute.apply(self, perm)

    @property
    def T(self):  # noqa: N802 - NumPy name
        return self.transpose()

    def sum(self, axis=None, keepdims: bool = False):
        return ops.Sum.apply(self, axis, keepdims, 1.0)

    def mean(self, axis=None, keepdims: bool = False):
        count = self.data.size if axis is None else int(np.prod(
            [self.data.shape[a] for a in np.atleast_1d(axis)]))
        return ops.Sum.apply(self, axis, keepdims, 1.0 / count)

    def split(self, split_size_or_sections, axis: int = -1):
        """Pieces along `axis` (PyTorch semantics): an int is the size of each piece,
        a list gives the sizes."""
        return ops.split(self, split_size_or_sections, axis)

    def chunk(self, chunks: int, axis: int = -1):
        return ops.chunk(self, chunks, axis)

    def exp(self):
        return ops.Exp.apply(self)

    def log(self):
        return ops.Log.apply(self)

    def tanh(self):
        return ops.Tanh.apply(self)


class _HookHandle:
    def __init__(self, hooks: list, hook):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _operand(value, like: Tensor):
    """A Python scalar or ndarray operand as an ndarray of `like`'s dtype.

    Casting scalars matters for bf16: `bf16_array * 0.5` would upcast to fp32.
    """
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray) and value.ndim > 0:
        return value
    return np.asarray(value, dtype=like.data.dtype)


def _new_tensor(data: np.ndarray, ctx: Context | None, index: int) -> Tensor:
    """Fast constructor for op outputs (skips the checks of `Tensor.__init__`)."""
    t = Tensor.__new__(Tensor)
    t.data = data
    t.grad = None
    t.requires_grad = ctx is not None
    t._ctx = ctx
    t._index = index
    t._post_accumulate_grad_hooks = None
    t._grad_device = None
    return t


# Tensor's methods call into these modules and they need Tensor: import them once it exists.
from minipar.autograd import engine, ops  # noqa: E402
