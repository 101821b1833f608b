"""Exercise 02: column- and row-parallel linear layers with Megatron's f and g.

Check your work:   python -m exercises.check 02

Tensor parallelism splits one matmul Y = X A over the t ranks of a TP group (Shoeybi et
al. 2019, "Megatron-LM", section 3 and figure 3). With A stored (in, out) and used as
X @ A (Hugging Face GPT-2's layout):

    column-parallel   A = [A_1 | A_2 | ... | A_t]    rank i computes Y_i = X A_i + b_i
                      (A split along its columns: every rank needs all of X, and its
                      output comes out split along the last dimension)
    row-parallel      A = [A_1; A_2; ...; A_t]      rank i computes X_i A_i, and
                      Y = sum_i X_i A_i + b         (A split along its rows: the input
                      comes in split, the outputs are partial sums)

Column then row needs no communication in between: the MLP's first Linear is column-
parallel, its output Y_i is exactly the input X_i the row-parallel second Linear needs.
Two conjugate operators mark where the parallel region starts and ends (figure 3):

    f   forward: identity            backward: all-reduce the gradient
    g   forward: all-reduce          backward: identity

f sits before the column-parallel matmul: every rank uses the same X, so dL/dX is the sum
of every rank's contribution. g sits after the row-parallel matmul and sums the partial
outputs; afterwards every rank holds the same Y, so its gradient is already complete.

Read minipar/autograd/tensor.py (the docstring at the top): a `Function` has static
`forward(ctx, *args)` on ndarrays and `backward(ctx, *grads)` returning one gradient per
forward argument (None for a non-tensor argument like `group`), and `.apply(...)` records
it in the graph. `minipar.autograd.functional.linear(x, weight, bias)` is x @ weight + b.

Write the TODOs below. Shapes for a TP group of t ranks, x of shape (B, T, in):
    column_parallel_linear   weight (in, out/t), bias (out/t,)  ->  (B, T, out/t)
    row_parallel_linear      x (B, T, in/t), weight (in/t, out), bias (out,)  ->  (B, T, out)

What the checker measures, for t = 2 and 4, in float64:
- your shards of a full weight (the right columns / rows for each rank);
- f and g on their own (forward values, gradients, one all-reduce each);
- forward values and the gradients of x, the weights and the biases against two
  single-device `minipar.nn.Linear` layers;
- communication: column -> row makes exactly one all-reduce in forward (g) of the
  (B, T, out) output and one in backward (f) of the (B, T, in) input gradient.
The checker refuses minipar.parallel (that is the answer key).
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist  # noqa: F401 - you will need dist.all_reduce
from minipar.autograd import Function, Tensor
from minipar.autograd import functional as F  # noqa: F401 - F.linear(x, weight, bias)


class CopyToTensorParallelRegion(Function):
    """f: identity in forward, all-reduce (sum over the group) of the gradient in backward.

    forward(ctx, x, group) -> x             x: ndarray (B, T, in), the same on every rank
    backward(ctx, grad) -> (summed grad, None)   one gradient per forward argument

    Hint: forward must remember `group` for backward: set `ctx.group = group`.
    """

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("f forward: your code here")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("f backward: your code here")


class ReduceFromTensorParallelRegion(Function):
    """g: all-reduce (sum over the group) in forward, identity in backward.

    forward(ctx, x, group) -> sum of x over the group     x: ndarray, a partial sum
    backward(ctx, grad) -> (grad, None)
    """

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("g forward: your code here")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("g backward: your code here")


def f(x: Tensor, group) -> Tensor:
    """Enter the tensor-parallel region (given)."""
    return CopyToTensorParallelRegion.apply(x, group)


def g(x: Tensor, group) -> Tensor:
    """Leave the tensor-parallel region (given)."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def column_shard(weight: np.ndarray, bias: np.ndarray, rank: int,
                 world: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s piece of a full Linear for the column-parallel layer.

    weight (in, out), bias (out,) -> (weight_i (in, out/world), bias_i (out/world,)):
    columns [rank * out/world, (rank + 1) * out/world) of both.
    """
    raise NotImplementedError("column_shard: your code here")


def row_shard(weight: np.ndarray, bias: np.ndarray, rank: int,
              world: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s piece of a full Linear for the row-parallel layer.

    weight (in, out), bias (out,) -> (weight_i (in/world, out), bias (out,)): rows
    [rank * in/world, (rank + 1) * in/world) of the weight; the bias is replicated (it is
    added once, after the sum).
    """
    raise NotImplementedError("row_shard: your code here")


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor, group) -> Tensor:
    """Y_i = X A_i + b_i on rank i.

    x (B, T, in), the same on every rank; weight (in, out/t) and bias (out/t,) are this
    rank's columns -> (B, T, out/t), this rank's columns of X A + b.
    Hint: one line. Which of f, g belongs at the entrance?
    """
    raise NotImplementedError("column_parallel_linear: your code here")


def row_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor, group) -> Tensor:
    """Y = sum_i X_i A_i + b on every rank.

    x (B, T, in/t) this rank's slice of the input (e.g. the column-parallel output);
    weight (in/t, out) this rank's rows; bias (out,) replicated -> (B, T, out).
    Hint: sum the partial products first, then add the bias once: adding it on every rank
    before the sum would add it t times.
    """
    raise NotImplementedError("row_parallel_linear: your code here")
