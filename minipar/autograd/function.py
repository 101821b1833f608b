"""`Function` and `Context`: how one op call becomes a node of the autograd graph.

A `Function` subclass has static `forward(ctx, *args)` and `backward(ctx, *grads)` on
plain ndarrays (example in tensor.py's docstring). `Function.apply` unwraps Tensor
arguments, runs `forward`, and, when grad is enabled and an input requires grad, keeps
the `ctx` as a node of the graph: `edges` point at what produced each input, and the
outputs are Tensors that remember the node. engine.py walks these nodes backwards.

Cost reporting (see tracking.py): each forward reports its FLOPs to the current device
(each node's backward does so in engine.py), and, to a device that prices kernels (a
roofline profile), the kernels they run: `ctx.kernels_forward` / `ctx.kernels_backward`
if the op sets them (GEMMs: minipar.autograd.kernels), else one kernel moving the op's
inputs and outputs; arrays saved for backward are held in the
device's ledger as "activations" from the moment they are saved until their node's
backward has run (`release_saved`).

Parameters (leaves that require grad) saved for backward are kept *by reference* and
read back as `param.data` when backward runs. They are not activations, and ZeRO-3 can
free a gathered weight after forward and gather it again before backward.
"""

from __future__ import annotations

import numpy as np

from minipar.autograd.grad_mode import _grad_enabled
from minipar.autograd.kernels import Kernel, array_bytes
from minipar.autograd.tracking import _current_device, charge


class Context:
    """The `ctx` of a Function call; when recorded, it is that call's graph node.

    Forward may set any attribute on it (shapes, flags) for backward to read.
    `flops_forward`/`flops_backward` are the FLOPs of this call's forward and backward;
    `kernels_forward`/`kernels_backward` (optional) the kernels they run (kernels.py).
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
        "kernels_forward",
        "kernels_backward",
        "_saved",
        "_held",
        "_device",
        "_parameters",
        "__dict__",
    )

    def __init__(self):
        self.function = None
        self.recording = False
        self.edges = None
        self.flops_forward = 0
        self.flops_backward = 0
        self.kernels_forward = None
        self.kernels_backward = None
        self._saved = ()
        self._held = None
        self._device = None
        self._parameters = ()  # while forward runs: the inputs that are parameters

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
        saved, held = [], []  # held: the arrays booked as activations
        for item in items:  # (None, a scalar, a tuple of ints... are kept as they are)
            if isinstance(item, Tensor):
                if item.requires_grad and item._ctx is None:
                    saved.append(item)
                    continue
                item = item.data
                held.append(item)
            elif isinstance(item, np.ndarray):
                for parameter in self._parameters:  # a parameter's .data: keep the parameter
                    if parameter.data is item:
                        item = parameter
                        break
                else:
                    held.append(item)
            saved.append(item)
        self._saved = tuple(saved)
        if held and device is not None:
            hold = device.memory.hold
            for array in held:
                hold(array, "activations")
            if self._held is None:
                self._held, self._device = held, device
            else:
                self._held += held

    @property
    def saved_tensors(self) -> tuple:
        """The saved items as ndarrays (parameters read as their current `.data`)."""
        if self._saved is None:
            raise RuntimeError(
                "the saved arrays of this node were freed by an earlier backward(); "
                "run forward again before calling backward() a second time"
            )
        # (a list comprehension, not a generator: cheaper, and this runs for every node)
        return tuple([s.data if isinstance(s, Tensor) else s for s in self._saved])

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
        # One pass over the arguments: the raw values forward receives and, with grad
        # enabled, the edge to whatever produced each input that needs a gradient (an
        # op's output, or a leaf: a parameter, whose saved .data save_for_backward keeps
        # by reference).
        raw, edges, needs, parameters = [], [], [], []
        record = False
        if _grad_enabled.get():
            for arg in args:
                if isinstance(arg, Tensor):
                    raw.append(arg.data)
                    if arg.requires_grad:
                        record = True
                        needs.append(True)
                        if arg._ctx is None:
                            edges.append((arg, 0))
                            parameters.append(arg)
                        else:
                            edges.append((arg._ctx, arg._index))
                        continue
                else:
                    raw.append(arg)
                edges.append(None)
                needs.append(False)
        else:
            for arg in args:
                raw.append(arg.data if isinstance(arg, Tensor) else arg)
        ctx = Context()
        if record:
            ctx.recording = True
            ctx.needs_input_grad = tuple(needs)
            ctx._parameters = parameters
        else:
            ctx.needs_input_grad = (False,) * len(args)
        out = cls.forward(ctx, *raw)
        flops = ctx.flops_forward
        if flops:
            device = _current_device.get()
            if device is None:
                pass
            elif getattr(device, "wants_kernels", False):
                kernels = ctx.kernels_forward or (Kernel(flops, array_bytes(raw)
                                                         + array_bytes(_as_tuple(out))),)
                charge(device, flops, "forward", cls.__name__, kernels)
            else:
                charge(device, flops, "forward", cls.__name__)
        if not record:
            if isinstance(out, tuple):
                return tuple(_new_tensor(o, None, 0) for o in out)
            return _new_tensor(out, None, 0)

        ctx._parameters = ()
        ctx.function = cls
        ctx.edges = edges
        if isinstance(out, tuple):
            ctx.out_shapes = tuple(o.shape for o in out)
            return tuple(_new_tensor(o, ctx, i) for i, o in enumerate(out))
        ctx.out_shapes = (out.shape,)
        return _new_tensor(out, ctx, 0)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


# Function.apply makes Tensors and tensor.py imports this module: import Tensor last, once
# Context and Function exist (see tensor.py's docstring).
from minipar.autograd.tensor import Tensor, _new_tensor  # noqa: E402
