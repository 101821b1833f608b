"""The reverse-mode engine: run the graph's `backward`s and fill the leaves' `.grad`.

`Tensor.backward()` calls `run_backward`, which walks the nodes (function.py's `Context`)
in reverse topological order (Kahn's algorithm with an explicit stack, so graph depth is
unlimited), sums the gradients arriving at each node, calls its `backward`, reports its
FLOPs to the current device and frees what it saved. It runs with the device's phase set
to "backward" (the device protocol in tracking.py), so whatever backward communicates is
charged to backward.

A leaf's gradient is accumulated once every use of the leaf has contributed
(`_accumulate_into_leaf`): its `.grad` is held as "grads" in the device's ledger from the
moment backward creates it, and then the leaf's post-accumulate-grad hooks run (data
parallelism and ZeRO start reducing gradients there while backward goes on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from minipar.autograd.function import Context
from minipar.autograd.kernels import Kernel, array_bytes
from minipar.autograd.tracking import _current_device, device_phase

if TYPE_CHECKING:  # only annotations: tensor.py imports this module
    from minipar.autograd.tensor import Tensor


def run_backward(root: Tensor, grad: np.ndarray) -> None:
    """Propagate `grad` from `root` to every leaf that requires grad, with the current
    device's phase set to "backward" (communication of backward hooks is charged to it)."""
    with device_phase(_current_device.get(), "backward"):
        _run_backward(root, grad)


def _run_backward(root: Tensor, grad: np.ndarray) -> None:
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
                _report_backward(device, node, grads, input_grads)
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


def _report_backward(device, node: Context, grads, input_grads) -> None:
    """Book a node's backward on the device: its FLOPs and, for a device that prices
    kernels, the kernels the op named or one reading the incoming gradients and the saved
    arrays and writing the input gradients (function.py). An op with no FLOPs and
    kernels_backward == () charged its backward itself as it ran (ring attention, which
    overlaps its blocks with communication: minipar.distributed.compute)."""
    if node.kernels_backward == () and not node.flops_backward:
        return
    if not getattr(device, "wants_kernels", False):
        device.compute(node.flops_backward, "backward")
        return
    kernels = node.kernels_backward
    if not kernels:
        saved = node.saved_tensors if node._saved is not None else ()
        nbytes = array_bytes(grads) + array_bytes(input_grads) + array_bytes(saved)
        kernels = (Kernel(node.flops_backward, nbytes),)
    device.compute(node.flops_backward, "backward", kernels)
