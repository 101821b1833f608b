"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2), from one rank's point of view.

Tensor parallelism (tensor.py) splits attention heads and the MLP hidden layer, but every
TP rank still holds the whole (B, T, d) activations of the LayerNorms, the dropouts and
the residual stream: they sit between the all-reduces, replicated. Sequence parallelism
cuts those regions along the sequence: rank i keeps tokens [i T/t, (i+1) T/t).

The all-reduce at the end of a tensor-parallel region is a reduce-scatter followed by an
all-gather, so it splits in two at no extra cost (the paper's figure 6):

    sequence-parallel region  --all-gather-->      tensor-parallel region     (g)
    tensor-parallel region    --reduce-scatter-->  sequence-parallel region   (g-bar)

Each is the other's conjugate in backward, and each moves (t-1)/t of the activation:
together exactly one all-reduce. Names follow Megatron-LM's mappings.py; the paper calls
the first `g` and the second `g-bar` (not to be confused with Shoeybi et al.'s f and g
in tensor.py).

Activations are (B, T, ...) here (Megatron uses (T, B, ...)), so the sequence is dim 1.

`SequenceParallelLinear` is the column-parallel linear layer entered from a sequence-
parallel region. Saving its all-gathered (B, T, d) input for backward would give back
what sequence parallelism saved, so, as Megatron does, it saves only this rank's
(B, T/t, d) piece and all-gathers it again in backward to form the weight gradient
(the paper: "an extra all-gather ... in the backward pass"; Megatron overlaps it with
the input-gradient matmul, we run it first).
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.precision import bfloat16, float32
from minipar.autograd.tensor import Function, Tensor

SEQUENCE_DIM = 1  # activations are (B, T, ...)


def _my_piece(x: np.ndarray, group) -> np.ndarray:
    """This rank's slice of x along the sequence (a copy, so it owns its memory)."""
    length, t = x.shape[SEQUENCE_DIM], group.size
    if length % t:
        raise ValueError(
            f"sequence parallelism: sequence length {length} is not divisible by the "
            f"tensor-parallel size {t}; use sequences whose length is a multiple of {t} "
            "(--seq-len) or turn --sequence-parallel off")
    piece = length // t
    start = dist.get_rank(group) * piece
    return np.ascontiguousarray(x[:, start:start + piece])


class ScatterToSequenceParallelRegion(Function):
    """Keep my sequence piece (forward, no communication); all-gather the gradient
    (backward). Where the replicated embedding output enters the sequence-parallel
    region. x (B, T, d) -> (B, T/t, d)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_piece(x, group)

    @staticmethod
    def backward(ctx, grad):
        return dist.all_gather(grad, group=ctx.group, dim=SEQUENCE_DIM), None


class GatherFromSequenceParallelRegion(Function):
    """All-gather along the sequence (forward); reduce-scatter the gradient (backward):
    the paper's `g`. x (B, T/t, d) -> (B, T, d)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return dist.all_gather(x, group=group, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return dist.reduce_scatter(grad, group=ctx.group, dim=SEQUENCE_DIM), None


class ReduceScatterToSequenceParallelRegion(Function):
    """Sum the group's partial outputs and keep my sequence piece (forward,
    reduce-scatter); all-gather the gradient (backward): the paper's `g-bar`.
    partial (B, T, d) -> (B, T/t, d)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if x.shape[SEQUENCE_DIM] % group.size:
            _my_piece(x, group)  # raises the clear error
        return dist.reduce_scatter(x, group=group, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return dist.all_gather(grad, group=ctx.group, dim=SEQUENCE_DIM), None


def scatter_to_sequence_parallel_region(x: Tensor, group) -> Tensor:
    return ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: Tensor, group) -> Tensor:
    return GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group) -> Tensor:
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


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
            full = dist.all_gather(x, group=group, dim=SEQUENCE_DIM)
            device = dist.get_device()
            device.memory.hold(full, "buffers")
        if need_x:
            w = weight if ctx.transpose_weight else weight.T  # (out/t, in)
            dx = _matmul(g2, w).astype(dtype, copy=False)
            dx = dx.reshape(*grad.shape[:-1], dx.shape[-1])  # (B, T, in), a partial sum
            grad_x = dist.reduce_scatter(dx, group=group, dim=SEQUENCE_DIM)
        if need_w:
            f2 = full.reshape(-1, full.shape[-1])
            dw = _matmul(g2.T, f2) if ctx.transpose_weight else _matmul(f2.T, g2)
            grad_w = dw.astype(dtype, copy=False)
            device.memory.release(full)
        if need_b:
            work = float32 if dtype == bfloat16 else dtype
            grad_b = g2.sum(axis=0, dtype=work).astype(dtype, copy=False)
        return grad_x, grad_w, grad_b, None, None


def sequence_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group,
                             transpose_weight: bool = False) -> Tensor:
    """Column-parallel linear entered from the sequence-parallel region; see
    `SequenceParallelLinear`."""
    return SequenceParallelLinear.apply(x, weight, bias, transpose_weight, group)
