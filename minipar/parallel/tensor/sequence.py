"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2), from one rank's point of view.

Tensor parallelism (layers.py) splits the heads and the MLP, but every TP rank still
holds the whole (B, T, d) activations of the LayerNorms, dropouts and residual stream
between the all-reduces. Sequence parallelism cuts those regions along the sequence
(rank i keeps tokens [i T/t, (i+1) T/t)) and splits each all-reduce, a reduce-scatter
then an all-gather, in two at no extra cost (the paper's figure 6; Megatron-LM's
mappings.py names):

    sequence-parallel region  --all-gather-->      tensor-parallel region     (g)
    tensor-parallel region    --reduce-scatter-->  sequence-parallel region   (g-bar)

The column-parallel layer entered from a sequence piece (`SequenceParallelLinear`) saves
only my (B, T/t, d) piece for backward and all-gathers it again there for the weight
gradient (the paper's "extra all-gather"; Megatron overlaps it with the input-gradient
matmul, we run it first). The LayerNorms and the row-parallel biases see only my tokens,
so their gradients are partial sums over TP: `SequenceParallelParameter`s (Megatron's
`param.sequence_parallel = True`), summed by f in each backward, or once per step in a
training run (sequence_grads.py). Activations are (B, T, ...) (Megatron: (T, B, ...)), so the
sequence is dim 1. `parallelize_tensor(..., sequence_parallel=True)` swaps these in.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd import functional as F
from minipar.autograd.function import Function
from minipar.autograd.kernels import linear_kernels
from minipar.autograd.placement import partial
from minipar.autograd.precision import bfloat16, float32
from minipar.autograd.tensor import Tensor
from minipar.nn import LayerNorm, Module, Parameter
from minipar.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minipar.parallel.tensor.sequence_grads import (
    copy_parameter_to_tensor_parallel_region,
    sequence_parallel_parameter,
)
from minipar.parallel.tensor.vocab import VocabParallelLMHead

SEQUENCE_DIM = 1  # activations are (B, T, ...)


# ---------------------------------------------------------------------------- regions
def my_sequence_piece(x: np.ndarray, group) -> np.ndarray:
    """This rank's slice of x along the sequence, a copy that owns its memory, so the
    whole x can be freed: Megatron-LM clones the embedding's scattered output for the
    same reason (`clone_scatter_output_in_embedding`, language_model_embedding.py: the
    slice "is a view, which prevents the original tensor from being garbage
    collected"). np.ascontiguousarray would not copy a slice that is already
    contiguous, as x[:, a:b] of one sequence (B = 1) is."""
    length, t = x.shape[SEQUENCE_DIM], group.size
    if length % t:
        raise ValueError(
            f"sequence parallelism: sequence length {length} is not divisible by the "
            f"tensor-parallel size {t}; use sequences whose length is a multiple of {t} "
            "(--seq-len) or turn --sequence-parallel off")
    piece = length // t
    start = dist.get_rank(group) * piece
    return x[:, start:start + piece].copy()


class ScatterToSequenceParallelRegion(Function):
    """Keep my sequence piece (forward, no communication); all-gather the gradient
    (backward). x (B, T, d) -> (B, T/t, d)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return my_sequence_piece(x, group)

    @staticmethod
    def backward(ctx, grad):
        return dist.all_gather(grad, group=ctx.group, dim=SEQUENCE_DIM), None


class GatherFromSequenceParallelRegion(Function):
    """All-gather along the sequence (forward); reduce-scatter the gradient (backward):
    the paper's `g`. x (B, T/t, d) -> (B, T, d).

    tensor_parallel_output_grad=False (Megatron's flag of the same name): what follows
    computes the same thing on every rank (an MoE layer routing all tokens), so each
    rank's gradient is already whole and backward keeps my tokens' piece of it."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad=True):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return dist.all_gather(x, group=group, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.reduce:
            return my_sequence_piece(grad, ctx.group), None, None
        return dist.reduce_scatter(grad, group=ctx.group, dim=SEQUENCE_DIM), None, None


class ReduceScatterToSequenceParallelRegion(Function):
    """Sum the group's partial outputs and keep my sequence piece (forward,
    reduce-scatter); all-gather the gradient (backward): the paper's `g-bar`.
    partial (B, T, d) -> (B, T/t, d)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if x.shape[SEQUENCE_DIM] % group.size:
            my_sequence_piece(x, group)  # raises the clear error
        return dist.reduce_scatter(x, group=group, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return dist.all_gather(grad, group=ctx.group, dim=SEQUENCE_DIM), None


def scatter_to_sequence_parallel_region(x: Tensor, group) -> Tensor:
    return ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: Tensor, group,
                                         tensor_parallel_output_grad: bool = True) -> Tensor:
    return GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group) -> Tensor:
    """g-bar: Partial() (B, T, d) in, my replicated-value tokens (B, T/t, d) out."""
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


# ---------------------------------------------------------------------------- linear
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
        y = F.matmul(x2, w)
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
            dx = F.matmul(g2, w).astype(dtype, copy=False)
            dx = dx.reshape(*grad.shape[:-1], dx.shape[-1])  # (B, T, in), a partial sum
            grad_x = dist.reduce_scatter(dx, group=group, dim=SEQUENCE_DIM)
        if need_w:
            f2 = full.reshape(-1, full.shape[-1])
            dw = F.matmul(g2.T, f2) if ctx.transpose_weight else F.matmul(f2.T, g2)
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


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on a sequence piece (B, T/t, d). Weight and bias are replicated but see
    only my tokens, so their gradients are summed over the TP group: by f's backward, or
    once per step when deferred (see SequenceParallelParameter). `name` (e.g.
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


# ---------------------------------------------------------------------------- layers
class SequenceParallelColumnLinear(ColumnParallelLinear):
    """A column-parallel linear layer entered from the sequence-parallel region: my
    tokens (B, T/t, in) -> (B, T, out/t), all-gathered inside (`SequenceParallelLinear`)."""

    def forward(self, x):
        return sequence_parallel_linear(x, self.weight, self.bias, self.group)


class SequenceParallelRowLinear(RowParallelLinear):
    """A row-parallel linear layer leaving into the sequence-parallel region: g-bar
    (reduce-scatter) instead of g. x (B, T, in/t) -> my tokens (B, T/t, out). Its bias
    meets only my tokens: a SequenceParallelParameter."""

    def __init__(self, weight: Parameter, bias: Parameter | None, group, *,
                 name: str = "RowParallelLinear"):
        if bias is not None:
            bias = sequence_parallel_parameter(bias, f"{name}.bias")
        super().__init__(weight, bias, group, name=name)

    def forward(self, x):
        # My rows' share of the sum, awaiting g-bar (reduce-scatter over TP).
        y = reduce_scatter_to_sequence_parallel_region(
            partial(F.linear(x, self.weight), self.name,
                    "g-bar (reduce_scatter_to_sequence_parallel_region)"), self.group)
        if self.bias is None:
            return y
        return y + copy_parameter_to_tensor_parallel_region(self.bias, self.group)


class SequenceParallelLMHead(VocabParallelLMHead):
    """The vocabulary-parallel LM head entered from the sequence-parallel region: my
    tokens (B, T/t, d) -> the logits of my words for every token (B, T, V/t)."""

    def logits(self, x, weight):
        return sequence_parallel_linear(x, weight, None, self.group, transpose_weight=True)


class SequenceParallelScatter(Module):
    """Where a replicated (B, T, d) activation enters the sequence-parallel region: my
    tokens (B, T/t, d) (GPT's embedding output; an MoE layer's output)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return scatter_to_sequence_parallel_region(x, self.group)


class SequenceParallelGather(Module):
    """All-gather my tokens into the whole (B, T, d) (an MoE layer's input, routed whole
    on every rank: tensor_parallel_output_grad=False, see the region function)."""

    def __init__(self, group, tensor_parallel_output_grad: bool = True):
        super().__init__()
        self.group, self.tensor_parallel_output_grad = group, tensor_parallel_output_grad

    def forward(self, x):
        return gather_from_sequence_parallel_region(x, self.group,
                                                    self.tensor_parallel_output_grad)
