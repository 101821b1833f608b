"""Exercise 10: sequence parallelism around a column- and a row-parallel layer.

Check your work:   python -m exercises.check 10

Tensor parallelism (exercise 02) splits the MLP's matmuls over the t ranks of a TP group,
but between its all-reduces every rank holds the whole (B, T, d) activations: the
LayerNorm's input and output, the residual stream. Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2, figure 5) cut those
regions along the sequence: rank i keeps only tokens [i T/t, (i+1) T/t). An all-reduce is
a reduce-scatter followed by an all-gather (exercise 01), so TP's two operators split in
two, at the same bytes (their figure 6; Megatron-LM's core/tensor_parallel/mappings.py):

    g       sequence region -> tensor region    forward: all-gather along the sequence
                                                backward: reduce-scatter along the sequence
    g-bar   tensor region -> sequence region    forward: reduce-scatter along the sequence
                                                backward: all-gather along the sequence

One MLP block with sequence parallelism, on rank i (x: my (B, T/t, d) piece):

    h = layer_norm(x, ln_weight, ln_bias)             my tokens only: (B, T/t, d)
    h = g(h)                                          all tokens:     (B, T, d)
    h = gelu(h @ w1 + b1)                             column-parallel (B, T, 4d/t)
    h = g-bar(h @ w2)                                 row-parallel partial sums, summed
                                                      and scattered:  (B, T/t, d)
    return x + h + b2                                 my tokens:      (B, T/t, d)

The LayerNorm's weight and bias, and b2, are replicated on every rank but see only my
tokens: after backward their gradients are partial sums over the TP group, and must be
all-reduced before the optimizer step (Megatron marks them `param.sequence_parallel` and
all-reduces them in `finalize_model_grads`; minipar/parallel/tensor/sequence_grads.py).

Activations are (B, T, ...) here (Megatron's are (T, B, ...)): the sequence is dim 1;
`dist.all_gather(x, group=group, dim=1)` and `dist.reduce_scatter(x, op="sum",
group=group, dim=1)` work along it. A `Function` is as in exercise 02: static
forward(ctx, *args) and backward(ctx, *grads), one gradient per forward argument.

What the checker measures, for t = 2 and 4, in float64, against one device's MLP block
on the whole (B, T, d) batch: each rank's output piece; the gradients of its x piece, of
its shards of w1, b1, w2 and of the replicated ln_weight, ln_bias, b2 (after
`allreduce_sequence_parallel_grads`); the communication: exactly one all-gather and one
reduce-scatter of (B, T, d) in forward, one of each in backward, no all-reduce there:
the 4(t-1)/t (B T d) elements TP's two all-reduces send (the paper's "same volume").
The checker refuses minipar.parallel (the answer key).
"""

from __future__ import annotations

import numpy as np  # noqa: F401 - you may need it

from minipar import distributed as dist  # noqa: F401 - dist.all_gather, dist.reduce_scatter
from minipar.autograd import Function, Tensor
from minipar.autograd import functional as F  # noqa: F401 - F.layer_norm, F.linear, F.gelu

SEQUENCE_DIM = 1


class GatherFromSequenceParallelRegion(Function):
    """g: all-gather along the sequence in forward, reduce-scatter (sum) in backward.

    forward(ctx, x, group) -> (B, T, d)       x: ndarray (B, T/t, d), my tokens
    backward(ctx, grad) -> ((B, T/t, d), None)

    Why a reduce-scatter in backward: every rank's column-parallel matmul uses all the
    tokens, so each rank's gradient of the gathered tensor is a partial sum; my tokens'
    gradient is the sum, over the ranks, of their gradients of my tokens."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("GatherFromSequenceParallelRegion.forward: your code here")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("GatherFromSequenceParallelRegion.backward: your code here")


class ReduceScatterToSequenceParallelRegion(Function):
    """g-bar: reduce-scatter (sum) along the sequence in forward, all-gather in backward.

    forward(ctx, x, group) -> (B, T/t, d)     x: ndarray (B, T, d), partial sums
    backward(ctx, grad) -> ((B, T, d), None)"""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError(
            "ReduceScatterToSequenceParallelRegion.forward: your code here")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "ReduceScatterToSequenceParallelRegion.backward: your code here")


def sequence_parallel_mlp(x: Tensor, ln_weight: Tensor, ln_bias: Tensor, w1: Tensor,
                          b1: Tensor, w2: Tensor, b2: Tensor, group) -> Tensor:
    """The MLP block above on this rank. x: (B, T/t, d); ln_weight, ln_bias, b2: (d,)
    replicated; w1 (d, 4d/t), b1 (4d/t,): my columns; w2 (4d/t, d): my rows.
    Returns my (B, T/t, d) piece of x + MLP(LN(x))."""
    raise NotImplementedError("sequence_parallel_mlp: your code here")


def allreduce_sequence_parallel_grads(params, group) -> None:
    """After backward: sum the gradients (p.grad, ndarrays) of the replicated parameters
    `params` (ln_weight, ln_bias, b2) over the TP group, in place (`p.grad[...] = ...`)."""
    raise NotImplementedError("allreduce_sequence_parallel_grads: your code here")
