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

The split backward of zero-bubble pipelines (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", section 2) is the same walk in two halves. `backward_input(root, grad,
inputs)` is B: it runs only the nodes on a path to `inputs` (the stage's input, what the
previous stage waits for), asking each for the gradients of the arguments on that path
(`needs_input_grad` narrowed, so Linear skips its weight GEMM) and leaves the rest queued in a
`WeightGradient`; its `.run()` is W: the weight-gradient work, replayed in the order the
unsplit walk would have run it, so every sum is formed in the same order and the
gradients are bit-for-bit those of `run_backward`. What W needs (the saved inputs of the
nodes it calls again, their output gradients, gradients already computed) stays booked in
the ledger as "activations" until W has run. PyTorch's pipelining does the same on its
autograd graph (torch/distributed/pipelining/_backward.py: `stage_backward_input`,
`stage_backward_weight`); the ZB repository queues Megatron's weight-gradient GEMMs in a
`WeightGradStore` (megatron/core/zbpp_utils.py) instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from minipar.autograd.function import Context
from minipar.autograd.kernels import Kernel, array_bytes
from minipar.autograd.precision import add
from minipar.autograd.tracking import _current_device, charge, device_phase

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
    walk = _Walk(root, grad)
    ready = [walk.start]
    while ready:
        node = ready.pop()
        grads = walk.take(node)
        input_grads = walk.call(node, grads)
        walk.report(node, grads, input_grads)
        node.release_saved()
        edges, node.edges = node.edges, None
        for edge, g in zip(edges, input_grads, strict=True):
            if walk.route(node, edge, g):
                ready.append(edge[0])


class _Walk:
    """One backward pass: pass 1's dependency counts and the gradients on their way.

    node_deps / leaf_deps: edges still to arrive at each node / leaf; pending: per node,
    the summed gradient of each output; leaf_pending: per leaf, [gradient, owned]."""

    def __init__(self, root: Tensor, grad: np.ndarray):
        start = root._ctx
        if start.edges is None:
            raise RuntimeError(_FREED_MESSAGE)
        self.start = start
        self.node_deps: dict[Context, int] = {}
        self.leaf_deps: dict[Tensor, int] = {}
        stack, seen = [start], {start}
        while stack:
            node = stack.pop()
            for edge in node.edges:
                if edge is None:
                    continue
                target = edge[0]
                if type(target) is Context:
                    self.node_deps[target] = self.node_deps.get(target, 0) + 1
                    if target not in seen:
                        if target.edges is None:
                            raise RuntimeError(_FREED_MESSAGE)
                        seen.add(target)
                        stack.append(target)
                else:
                    self.leaf_deps[target] = self.leaf_deps.get(target, 0) + 1
        self.pending: dict[Context, list] = {start: [None] * len(start.out_shapes)}
        self.pending[start][root._index] = grad
        self.leaf_pending: dict[Tensor, list] = {}
        self.device = _current_device.get()

    def order(self) -> list[Context]:
        """The nodes in the order `_run_backward` runs them (the same stack discipline,
        without computing anything)."""
        deps = dict(self.node_deps)
        ready, order = [self.start], []
        while ready:
            node = ready.pop()
            order.append(node)
            for edge in node.edges:
                if edge is not None and type(edge[0]) is Context:
                    deps[edge[0]] -= 1
                    if deps[edge[0]] == 0:
                        ready.append(edge[0])
        return order

    def take(self, node: Context) -> list | None:
        """The summed output gradients of `node` (None if no gradient reached it)."""
        grads = self.pending.pop(node, None)
        if grads is None:
            return None
        if len(grads) == 1:  # most ops have one output
            return None if grads[0] is None else grads
        if all(g is None for g in grads):
            return None
        # unused outputs of a multi-output op get zeros
        return [np.zeros(shape, dtype=_grad_dtype(grads)) if g is None else g
                for g, shape in zip(grads, node.out_shapes, strict=True)]

    def call(self, node: Context, grads: list | None, needs: tuple | None = None) -> tuple:
        """node's backward on `grads`: one gradient per forward argument. `needs`
        narrows `needs_input_grad` for this call (the split backward's B or W)."""
        if grads is None:
            return (None,) * len(node.edges)
        if needs is None:
            input_grads = node.function.backward(node, *grads)
        else:
            everything, node.needs_input_grad = node.needs_input_grad, needs
            try:
                input_grads = node.function.backward(node, *grads)
            finally:
                node.needs_input_grad = everything
        if not isinstance(input_grads, tuple):
            input_grads = (input_grads,)
        if len(input_grads) != len(node.edges):
            raise RuntimeError(
                f"{node.function.__name__}.backward returned {len(input_grads)} "
                f"gradients for {len(node.edges)} forward arguments"
            )
        return input_grads

    def report(self, node: Context, grads, input_grads, arguments=None) -> None:
        """Book node's backward on the device (`_report_backward`); with `arguments`,
        only the gradients of those forward arguments (a split backward's B or W), priced
        by the op's `ctx.backward_by_input` (per argument, the kernels of its gradient)."""
        if self.device is None or grads is None or not node.flops_backward:
            return
        if arguments is None:
            _report_backward(self.device, node, grads, input_grads)
            return
        kernels = tuple(k for i in arguments for k in node.backward_by_input[i])
        flops = sum(k.flops for k in kernels)
        if flops and getattr(self.device, "wants_kernels", False):
            self.device.compute(flops, "backward", kernels)
        elif flops:
            self.device.compute(flops, "backward")

    def route(self, node: Context, edge, g) -> bool:
        """Send gradient `g` (or None) along `edge` of `node`: sum it into its target.
        True if the target is a node all of whose consumers have now sent theirs (it is
        ready to run); a complete leaf gradient is accumulated into `.grad`."""
        if edge is None:
            return False
        target, index = edge
        if type(target) is Context:
            if g is not None:
                expected = target.out_shapes[index]
                if g.shape != expected:
                    raise _shape_error(node, target.function.__name__, g.shape, expected)
                slots = self.pending.get(target)
                if slots is None:
                    slots = self.pending[target] = [None] * len(target.out_shapes)
                slots[index] = g if slots[index] is None else add(slots[index], g)
            remaining = self.node_deps[target] - 1
            self.node_deps[target] = remaining
            return remaining == 0
        if g is not None:
            if g.shape != target.data.shape:
                raise _shape_error(node, "a leaf", g.shape, target.data.shape)
            entry = self.leaf_pending.get(target)
            if entry is None:
                self.leaf_pending[target] = [g, False]
            else:
                entry[0] = add(entry[0], g)
                entry[1] = True  # a fresh array: no copy needed
        remaining = self.leaf_deps[target] - 1
        self.leaf_deps[target] = remaining
        if remaining == 0:
            entry = self.leaf_pending.pop(target, None)
            if entry is not None:
                _accumulate_into_leaf(target, entry[0], owned=entry[1])
        return False


# --------------------------------------------------------------------------- B and W
def backward_input(root: Tensor, grad: np.ndarray, inputs) -> WeightGradient:
    """B of the split backward: propagate `grad` from `root` only as far as `inputs`.

    inputs: the Tensors whose gradient is needed now (a stage's received activation, a
    leaf whose `.grad` is then filled; or an intermediate such as the first stage's
    embedding output, where B stops). Every node on a path from root to an input runs,
    asked only for the gradients on that path; whatever else its backward would have
    produced (weight gradients, and everything below the inputs) is left in the returned
    WeightGradient, whose `run()` (W) finishes the pass. Equal to `run_backward` bit for
    bit once W has run.
    """
    with device_phase(_current_device.get(), "backward"):
        return WeightGradient(root, grad, inputs)


class WeightGradient:
    """The W half of a split backward (built by `backward_input`, which runs B).

    `run()` once: the deferred weight-gradient work, then the graph is freed. Until then
    `held_bytes()` is what it keeps on the device for W (booked as "activations")."""

    def __init__(self, root: Tensor, grad: np.ndarray, inputs):
        self._held: list[np.ndarray] = []
        self._done = root._ctx is None
        if self._done:
            _accumulate_into_leaf(root, grad, owned=False)
            return
        walk = self._walk = _Walk(root, grad)
        self._order = walk.order()
        leaves = {id(t) for t in inputs if t._ctx is None}
        outputs = {(t._ctx, t._index) for t in inputs if t._ctx is not None}

        def leads(edge) -> bool:  # does this edge's gradient flow on to an input?
            return edge is not None and (edge[0] in on_path or id(edge[0]) in leaves
                                         or edge in outputs)

        on_path: set[Context] = set()
        for node in reversed(self._order):  # producers before their consumers
            if any(leads(edge) for edge in node.edges):
                on_path.add(node)
        self._on_path = on_path
        self._deferred: dict[Context, tuple] = {}  # node -> (grads, deferred gradients)
        ready = [walk.start] if walk.start in on_path else []
        while ready:
            node = ready.pop()
            grads = walk.take(node)
            needs = tuple(leads(edge) for edge in node.edges)
            input_grads = walk.call(node, grads, needs)
            # a backward that computes every gradient anyway (LayerNorm) keeps them for W
            later = {k: g for k, g in enumerate(input_grads)
                     if node.edges[k] is not None and not needs[k]}
            again = grads is not None and any(g is None for g in later.values())
            if getattr(node, "backward_by_input", None) is None:  # B pays it all
                walk.report(node, grads, input_grads)
            else:  # what B asked for, and what the op computed anyway
                walk.report(node, grads, input_grads, [
                    k for k in range(len(needs)) if needs[k] or later.get(k) is not None])
            self._hold(g for g in later.values() if g is not None)
            if again:  # W calls backward again: keep its saved inputs and output gradient
                self._hold(g for g in grads if g is not None)
            else:
                node.release_saved()
            self._deferred[node] = (grads if again else None, later)
            for k, (edge, g) in enumerate(zip(node.edges, input_grads, strict=True)):
                if needs[k] and walk.route(node, edge, g) and edge[0] in on_path:
                    ready.append(edge[0])
        # gradients that reached nodes below the inputs wait there for W
        self._hold(g for node, slots in walk.pending.items() if node not in on_path
                   for g in slots if g is not None)

    def _hold(self, arrays) -> None:
        device = _current_device.get()
        for array in arrays:
            if device is not None:
                device.memory.hold(array, "activations")
            self._held.append(array)

    def held_bytes(self) -> int:
        """Bytes this W keeps alive beyond the graph's saved arrays (distinct buffers)."""
        return sum({id(a): a.nbytes for a in self._held}.values())

    def run(self) -> None:
        """W: the deferred gradients, in the unsplit walk's order; then free the graph."""
        if self._done:
            raise RuntimeError("this weight-gradient work already ran")
        self._done = True
        with device_phase(_current_device.get(), "backward"):
            walk = self._walk
            for node in self._order:
                if node in self._on_path:
                    grads, later = self._deferred.pop(node)
                    if grads is not None:
                        needs = tuple(k in later and later[k] is None
                                      for k in range(len(node.edges)))
                        again = walk.call(node, grads, needs)
                        if getattr(node, "backward_by_input", None) is not None:
                            walk.report(node, grads, again,
                                        [k for k in range(len(needs)) if needs[k]])
                        later = {k: (again[k] if g is None else g) for k, g in later.items()}
                        node.release_saved()
                    for k, g in later.items():
                        walk.route(node, node.edges[k], g)
                else:
                    grads = walk.take(node)
                    input_grads = walk.call(node, grads)
                    walk.report(node, grads, input_grads)
                    node.release_saved()
                    for edge, g in zip(node.edges, input_grads, strict=True):
                        walk.route(node, edge, g)
                node.edges = None
            device = _current_device.get()
            for array in self._held:
                if device is not None:
                    device.memory.release(array)
            self._held = []
            self._walk = self._order = self._on_path = None


def _accumulate_into_leaf(leaf: Tensor, grad: np.ndarray, owned: bool) -> None:
    """Add a finished gradient into `leaf.grad` (in the leaf's `grad_dtype` if it has
    one: a bf16 weight's fp32 gradient buffer sums each backward's bf16 gradient), then
    run its post-accumulate hooks."""
    dtype = getattr(leaf, "grad_dtype", None) or leaf.data.dtype
    if grad.dtype != dtype:
        grad = grad.astype(dtype)
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
        add(leaf.grad, grad, out=leaf.grad)
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
    op = node.function.__name__
    if not getattr(device, "wants_kernels", False):
        charge(device, node.flops_backward, "backward", op)
        return
    kernels = node.kernels_backward
    if not kernels:
        saved = node.saved_tensors if node._saved is not None else ()
        nbytes = array_bytes(grads) + array_bytes(input_grads) + array_bytes(saved)
        kernels = (Kernel(node.flops_backward, nbytes),)
    charge(device, node.flops_backward, "backward", op, kernels)
