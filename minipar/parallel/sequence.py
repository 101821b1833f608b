"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2), from one rank's point of view.

Tensor parallelism (tensor_layers.py) splits attention heads and the MLP hidden layer,
but every TP rank still holds the whole (B, T, d) activations of the LayerNorms, the
dropouts and the residual stream: they sit between the all-reduces, replicated. Sequence
parallelism cuts those regions along the sequence: rank i keeps tokens [i T/t, (i+1) T/t).

The all-reduce at the end of a tensor-parallel region is a reduce-scatter followed by an
all-gather, so it splits in two at no extra cost (the paper's figure 6):

    sequence-parallel region  --all-gather-->      tensor-parallel region     (g)
    tensor-parallel region    --reduce-scatter-->  sequence-parallel region   (g-bar)

Those region functions are in mappings.py (Megatron-LM's mappings.py names; the paper
calls the first `g` and the second `g-bar`, not to be confused with Shoeybi et al.'s f
and g). This module holds the layers that run on a sequence piece:

`SequenceParallelLinear` is the column-parallel linear layer entered from a sequence-
parallel region. Saving its all-gathered (B, T, d) input for backward would give back
what sequence parallelism saved, so, as Megatron does, it saves only this rank's
(B, T/t, d) piece and all-gathers it again in backward to form the weight gradient
(the paper: "an extra all-gather ... in the backward pass"; Megatron overlaps it with
the input-gradient matmul, we run it first).

`SequenceParallelLayerNorm` and the row-parallel biases use replicated parameters on my
tokens only, so their gradients are partial sums over the TP group. They are
`SequenceParallelParameter`s (Megatron marks them `param.sequence_parallel = True` and
all-reduces their gradients in `finalize_model_grads`); here they enter the graph
through f, whose backward all-reduces their gradient, and a gradient that reaches
`.grad` without that all-reduce is refused with a PlacementError (each TP replica would
otherwise take a different optimizer step).
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd import functional as F
from minipar.autograd.kernels import linear_kernels
from minipar.autograd.placement import PlacementError
from minipar.autograd.precision import bfloat16, float32
from minipar.autograd.tensor import Function, Tensor
from minipar.nn import LayerNorm, Parameter
from minipar.parallel.mappings import SEQUENCE_DIM, copy_to_tensor_parallel_region


# ---------------------------------------------------------------------------- linear
def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """2-D a @ b; bf16 in, fp32 accumulate (a tensor core), result in fp32 for bf16."""
    if a.dtype == bfloat16:
        return a.astype(float32) @ b.astype(float32)
    return a @ b


class SequenceParallelLinear(Function):
    """y = all_gather(x) @ W + b, saving only this rank's piece of x for backward.

    x: (B, T/t, in) sequence piece; weight: (in, out/t), or (out/t, in) used transposed
    (the vocab-parallel LM head); bias: (out/t,) or None; returns (B, T, out/t).
    Backward: all-gather x again (for dW), dx = reduce_scatter(dy @ W^T) along T.
    Same arithmetic and FLOPs as minipar.autograd.functional.Linear.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, transpose_weight, group):
        full = dist.all_gather(x, group=group, dim=SEQUENCE_DIM)  # (B, T, in)
        w = weight.T if transpose_weight else weight
        x2 = full.reshape(-1, full.shape[-1])
        y = _matmul(x2, w)
        if bias is not None:
            y += bias.astype(y.dtype, copy=False)
        # Only the piece: 1/t of the input, the memory sequence parallelism is for.
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.transpose_weight = group, transpose_weight
        m, n = y.shape
        ctx.flops_forward = 2 * m * x2.shape[1] * n + (m * n if bias is not None else 0)
        ctx.flops_backward = 4 * m * x2.shape[1] * n + (m * n if bias is not None else 0)
        ctx.kernels_forward, ctx.kernels_backward = linear_kernels(
            m, n, x2.shape[1], x.dtype.itemsize, bias is not None)
        # per argument, the kernels of its gradient (the split backward's B takes dx,
        # W the weight GEMM with the bias in its epilogue: engine.backward_input)
        ctx.backward_by_input = ((ctx.kernels_backward[0],), (ctx.kernels_backward[1],),
                                 (), (), ())
        return y.astype(x.dtype, copy=False).reshape(*full.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group = ctx.group
        dtype = grad.dtype
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        full = None
        if need_w:
            # The extra all-gather of Korthikanti et al.: the full input is a transient
            # buffer again, alive only while the weight gradient is formed.
            full = dist.all_gather(x, group=group, dim=SEQUENCE_DIM, category="buffers")
        if need_x:
            w = weight if ctx.transpose_weight else weight.T  # (out/t, in)
            dx = _matmul(g2, w).astype(dtype, copy=False)
            dx = dx.reshape(*grad.shape[:-1], dx.shape[-1])  # (B, T, in), a partial sum
            grad_x = dist.reduce_scatter(dx, group=group, dim=SEQUENCE_DIM)
        if need_w:
            f2 = full.reshape(-1, full.shape[-1])
            dw = _matmul(g2.T, f2) if ctx.transpose_weight else _matmul(f2.T, g2)
            grad_w = dw.astype(dtype, copy=False)
            dist.release(full)
        if need_b:
            work = float32 if dtype == bfloat16 else dtype
            grad_b = g2.sum(axis=0, dtype=work).astype(dtype, copy=False)
        return grad_x, grad_w, grad_b, None, None


def sequence_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group,
                             transpose_weight: bool = False) -> Tensor:
    """Column-parallel linear entered from the sequence-parallel region; see
    `SequenceParallelLinear`."""
    return SequenceParallelLinear.apply(x, weight, bias, transpose_weight, group)


# ---------------------------------------------------------------------------- parameters
class SequenceParallelParameter(Parameter):
    """A replicated parameter that meets only my sequence piece: its gradient from one
    backward is this rank's Partial() summand until f's backward all-reduces it over TP.

    f calls `mark_reduced` after that all-reduce; a post-accumulate-grad hook (which runs
    before any data-parallel engine's) refuses a gradient that arrives without it. One
    flag per parameter and backward: no time on the clock, no communication."""

    __slots__ = ("name", "reduced")

    def mark_reduced(self) -> None:
        self.reduced = True


def _refuse_unreduced_gradient(param: SequenceParallelParameter) -> None:
    if not param.reduced:
        raise PlacementError(
            f"{param.name}: its gradient is Partial(sum) over the tensor-parallel group "
            "(under sequence parallelism it sees only this rank's tokens) and reached .grad "
            "without the all-reduce of f (copy_to_tensor_parallel_region's backward): the "
            "optimizer and the gradient norm need Replicate(), else each TP replica steps "
            "differently")
    param.reduced = False  # the next backward must reduce again


def sequence_parallel_parameter(param: Parameter, name: str) -> SequenceParallelParameter:
    """`param` (same data, placement and group) as a SequenceParallelParameter."""
    marked = SequenceParallelParameter(param.data, requires_grad=param.requires_grad,
                                       placement=param.placement,
                                       placement_group=param.placement_group)
    marked.grad_category = param.grad_category
    marked.name, marked.reduced = name, False
    marked.register_post_accumulate_grad_hook(_refuse_unreduced_gradient)
    return marked


def copy_parameter_to_tensor_parallel_region(param: Parameter, group) -> Tensor:
    """f for a SequenceParallelParameter: all-reduce its gradient in backward and note it."""
    return copy_to_tensor_parallel_region(param, group,
                                          on_reduced=getattr(param, "mark_reduced", None))


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on a sequence piece (B, T/t, d). Weight and bias are replicated but see
    only my tokens, so they enter through f: backward all-reduces their gradients over
    the TP group (Megatron's all-reduce of `sequence_parallel` parameters). `name` (e.g.
    "h.0.ln_1") names them in placement errors."""

    def __init__(self, layer_norm: LayerNorm, group, name: str = "LayerNorm"):
        super().__init__(layer_norm.weight.shape[0], layer_norm.eps,
                         dtype=layer_norm.weight.dtype)
        self.weight = sequence_parallel_parameter(layer_norm.weight, f"{name}.weight")
        self.bias = sequence_parallel_parameter(layer_norm.bias, f"{name}.bias")
        self.group = group

    def forward(self, x):
        return F.layer_norm(x, copy_parameter_to_tensor_parallel_region(self.weight, self.group),
                            copy_parameter_to_tensor_parallel_region(self.bias, self.group),
                            self.eps)
