"""`Tensor`, `Function` and the reverse-mode engine: the whole autograd in one place.

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

When grad is enabled and an input requires grad, `apply` keeps the `ctx` as a node of
the graph. `Tensor.backward()` then walks the nodes in reverse topological order
(Kahn's algorithm with an explicit stack, so graph depth is unlimited), sums the
gradients arriving at each node, calls its `backward` and frees what it saved.

Cost reporting (see tracking.py): each forward and each node's backward reports its
FLOPs to the current device; arrays saved for backward are held in the device's ledger
as "activations" from the moment they are saved until their node's backward has run;
a leaf's `.grad` is held as "grads" from the moment backward creates it.

Parameters (leaves that require grad) saved for backward are kept *by reference* and
read back as `param.data` when backward runs. They are not activations, and ZeRO-3 can
free a gathered weight after forward and gather it again before backward.
"""

from __future__ import annotations

import numpy as np

from minipar.autograd.grad_mode import _grad_enabled
from minipar.autograd.tracking import _current_device


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
        run_backward(self, grad)

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


class Context:
    """The `ctx` of a Function call; when recorded, it is that call's graph node.

    Forward may set any attribute on it (shapes, flags) for backward to read.
    `flops_forward`/`flops_backward` are the FLOPs of this call's forward and backward.
    `edges[i]` points at whatever produced forward argument i: `(node, output_index)` for
    an op output, `(leaf_tensor, 0)` for a leaf that requires grad, None otherwise.
    """

    __slots__ = (
        "function",
        "needs_input_grad",
        "recording",
        "edges",
        "out_shapes",
        "flops_forward",
        "flops_backward",
        "_saved",
        "_held",
        "_device",
        "_inputs",
        "__dict__",
    )

    def __init__(self):
        self.function = None
        self.recording = False
        self.edges = None
        self.flops_forward = 0
        self.flops_backward = 0
        self._saved = ()
        self._held = None
        self._device = None
        self._inputs = None

    def save_for_backward(self, *items) -> None:
        """Keep ndarrays (or Tensors) for backward; read them back via `saved_tensors`.

        Saved arrays are activations: held in the device ledger until this node's
        backward has run. The `.data` of a parameter input (a leaf that requires grad)
        is instead kept as a reference to the parameter and re-read at backward time.
        Nothing is kept when the call is not recorded (no_grad, or no input needs grad).
        """
        if not self.recording:
            return
        device = _current_device.get()
        saved = []
        for item in items:
            if isinstance(item, Tensor):
                if item.requires_grad and item._ctx is None:
                    saved.append(item)
                    continue
                item = item.data
            elif isinstance(item, np.ndarray):
                parameter = self._parameter_holding(item)
                if parameter is not None:
                    saved.append(parameter)
                    continue
            else:  # None, a scalar, a tuple of ints...
                saved.append(item)
                continue
            if device is not None:
                device.memory.hold(item, "activations")
                if self._held is None:
                    self._held = []
                    self._device = device
                self._held.append(item)
            saved.append(item)
        self._saved = tuple(saved)

    def _parameter_holding(self, array: np.ndarray) -> Tensor | None:
        for arg in self._inputs:
            if isinstance(arg, Tensor) and arg.data is array and arg._ctx is None \
                    and arg.requires_grad:
                return arg
        return None

    @property
    def saved_tensors(self) -> tuple:
        """The saved items as ndarrays (parameters read as their current `.data`)."""
        if self._saved is None:
            raise RuntimeError(
                "the saved arrays of this node were freed by an earlier backward(); "
                "run forward again before calling backward() a second time"
            )
        return tuple(s.data if isinstance(s, Tensor) else s for s in self._saved)

    def release_saved(self) -> None:
        """Free what forward saved and release it from the ledger."""
        if self._held is not None:
            release = self._device.memory.release
            for array in self._held:
                release(array)
            self._held = None
        self._saved = None

    def __del__(self):
        # A graph dropped without backward (e.g. an evaluation forward with grad on)
        # frees its activations here, so the ledger matches what is really held.
        if self._held is not None:
            try:
                self.release_saved()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass


class Function:
    """Base class of differentiable ops; subclass with static `forward` and `backward`.

    `forward(ctx, *args)` receives Tensor arguments as their `.data` ndarrays and any
    other argument unchanged, and returns an ndarray or a tuple of ndarrays.
    `backward(ctx, *grad_outputs)` receives one gradient per output and returns one
    gradient (ndarray, or None) per forward argument, in order (a single value when
    forward had a single argument).
    """

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args):
        raw = []
        record = False
        if _grad_enabled.get():
            needs = []
            for arg in args:
                if isinstance(arg, Tensor):
                    raw.append(arg.data)
                    needs.append(arg.requires_grad)
                    if arg.requires_grad:
                        record = True
                else:
                    raw.append(arg)
                    needs.append(False)
        else:
            for arg in args:
                raw.append(arg.data if isinstance(arg, Tensor) else arg)
        ctx = Context()
        if record:
            ctx.recording = True
            ctx.needs_input_grad = tuple(needs)
            ctx._inputs = args
        else:
            ctx.needs_input_grad = (False,) * len(args)
        out = cls.forward(ctx, *raw)
        device = _current_device.get()
        if device is not None and ctx.flops_forward:
            device.compute(ctx.flops_forward, "forward")
        if not record:
            if isinstance(out, tuple):
                return tuple(_new_tensor(o, None, 0) for o in out)
            return _new_tensor(out, None, 0)

        ctx._inputs = None
        ctx.function = cls
        edges = []
        for arg, need in zip(args, needs, strict=True):
            if not need:
                edges.append(None)
            elif arg._ctx is None:
                edges.append((arg, 0))
            else:
                edges.append((arg._ctx, arg._index))
        ctx.edges = edges
        if isinstance(out, tuple):
            ctx.out_shapes = tuple(o.shape for o in out)
            return tuple(_new_tensor(o, ctx, i) for i, o in enumerate(out))
        ctx.out_shapes = (out.shape,)
        return _new_tensor(out, ctx, 0)


def run_backward(root: Tensor, grad: np.ndarray) -> None:
    """Propagate `grad` from `root` to every leaf that requires grad.

    Pass 1 finds the nodes reachable from the root and counts, for each node and
    each leaf, how many edges point at it. Pass 2 processes a node only once all of its
    consumers have sent their gradient (Kahn's algorithm), so each node's backward runs
    once on the summed gradient, and a leaf is complete when its count reaches zero.
    """
    if root._ctx is None:
        _accumulate_into_leaf(root, grad, owned=False)
        return
    start = root._ctx
    if start.edges is None:
        raise RuntimeError(_FREED_MESSAGE)

    # Pass 1: dependency counts.
    node_deps: dict[Context, int] = {}
    leaf_deps: dict[Tensor, int] = {}
    stack = [start]
    seen = {start}
    while stack:
        node = stack.pop()
        for edge in node.edges:
            if edge is None:
                continue
            target = edge[0]
            if type(target) is Context:
                node_deps[target] = node_deps.get(target, 0) + 1
                if target not in seen:
                    if target.edges is None:
                        raise RuntimeError(_FREED_MESSAGE)
                    seen.add(target)
                    stack.append(target)
            else:
                leaf_deps[target] = leaf_deps.get(target, 0) + 1

    # Pass 2: run the nodes; `pending` sums the gradients arriving at each output.
    pending: dict[Context, list] = {start: [None] * len(start.out_shapes)}
    pending[start][root._index] = grad
    leaf_pending: dict[Tensor, list] = {}
    ready = [start]
    device = _current_device.get()
    while ready:
        node = ready.pop()
        grads = pending.pop(node, None)
        edges = node.edges
        if grads is None or all(g is None for g in grads):
            input_grads = (None,) * len(edges)
        else:
            if len(grads) > 1:  # unused outputs of a multi-output op get zeros
                grads = [np.zeros(shape, dtype=_grad_dtype(grads)) if g is None else g
                         for g, shape in zip(grads, node.out_shapes, strict=True)]
            input_grads = node.function.backward(node, *grads)
            if not isinstance(input_grads, tuple):
                input_grads = (input_grads,)
            if len(input_grads) != len(edges):
                raise RuntimeError(
                    f"{node.function.__name__}.backward returned {len(input_grads)} "
                    f"gradients for {len(edges)} forward arguments"
                )
            if device is not None and node.flops_backward:
                device.compute(node.flops_backward, "backward")
        node.release_saved()
        node.edges = None

        for edge, g in zip(edges, input_grads, strict=True):
            if edge is None:
                continue
            target, index = edge
            if type(target) is Context:
                if g is not None:
                    expected = target.out_shapes[index]
                    if g.shape != expected:
                        raise _shape_error(node, target.function.__name__, g.shape, expected)
                    slots = pending.get(target)
                    if slots is None:
                        slots = pending[target] = [None] * len(target.out_shapes)
                    slots[index] = g if slots[index] is None else slots[index] + g
                remaining = node_deps[target] - 1
                node_deps[target] = remaining
                if remaining == 0:
                    ready.append(target)
            else:
                if g is not None:
                    if g.shape != target.data.shape:
                        raise _shape_error(node, "a leaf", g.shape, target.data.shape)
                    entry = leaf_pending.get(target)
                    if entry is None:
                        leaf_pending[target] = [g, False]
                    else:
                        entry[0] = entry[0] + g
                        entry[1] = True  # a fresh array: no copy needed
                remaining = leaf_deps[target] - 1
                leaf_deps[target] = remaining
                if remaining == 0:
                    entry = leaf_pending.pop(target, None)
                    if entry is not None:
                        _accumulate_into_leaf(target, entry[0], owned=entry[1])


def _accumulate_into_leaf(leaf: Tensor, grad: np.ndarray, owned: bool) -> None:
    """Add a finished gradient into `leaf.grad`, then run its post-accumulate hooks."""
    if grad.dtype != leaf.data.dtype:
        grad = grad.astype(leaf.data.dtype)
        owned = True
    if leaf.grad is None:
        # The array may be shared with other consumers (Add passes one gradient to both
        # inputs): copy unless it was freshly made here, because .grad is updated in place.
        leaf.grad = grad if owned else grad.copy()
        device = _current_device.get()
        if device is not None:
            # A Parameter may book its gradient elsewhere: ZeRO-2/3 keep only a shard as
            # "grads" and count the transient full gradient as a "buffers" array.
            device.memory.hold(leaf.grad, getattr(leaf, "grad_category", "grads"))
            leaf._grad_device = device
    else:
        leaf.grad += grad
    if leaf._post_accumulate_grad_hooks:
        for hook in tuple(leaf._post_accumulate_grad_hooks):
            hook(leaf)


def _grad_dtype(grads: list) -> np.dtype:
    return next(g.dtype for g in grads if g is not None)


def _shape_error(node: Context, target: str, got, expected) -> RuntimeError:
    return RuntimeError(
        f"{node.function.__name__}.backward returned a gradient of shape {got} for "
        f"{target} of shape {expected}"
    )


_FREED_MESSAGE = (
    "backward() through a graph that was already freed by an earlier backward(); "
    "run forward again"
)

# The operator methods above call into ops, which subclasses Function: import it last.
from minipar.autograd import ops  # noqa: E402
