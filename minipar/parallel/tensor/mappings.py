"""f and g: the communication at the edges of a tensor-parallel region (Shoeybi et al.
2019, figure 3), from one rank's point of view.

Each function is an autograd op whose forward and backward are a collective (or nothing)
over the TP group, so a layer says *where* its data changes placement and the backward
pass gets the conjugate communication for free. Names and pairing follow Megatron-LM's
`megatron/core/tensor_parallel/mappings.py` (picotron keeps the same idea apart from its
layers in `picotron/tensor_parallel/tp_communications.py`); the layers that use them are
in layers.py and vocab.py, the sequence-parallel regions in sequence.py.

    copy_to_tensor_parallel_region       f: identity forward, all-reduce backward
    reduce_from_tensor_parallel_region   g: all-reduce forward, identity backward
    gather_from_tensor_parallel_region   all-gather the last dim forward, keep my slice
                                         of the gradient backward (full logits, for
                                         generation only)

A row-parallel matmul's output is Partial() (minipar.autograd.placement) until g sums
it: `RowParallelLinear` marks it, and `require_replicated` refuses it where a whole value
is needed, so a forgotten reduction is a loud error.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.function import Function
from minipar.autograd.tensor import Tensor


# ---------------------------------------------------------------------------- TP: f and g
class CopyToTensorParallelRegion(Function):
    """f: identity forward, all-reduce of the gradient backward (Shoeybi et al. 2019,
    figure 3). Every rank uses the same X in its own part of the computation, so dL/dX
    is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, group, on_reduced):
        ctx.group, ctx.on_reduced = group, on_reduced
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = dist.all_reduce(grad, group=ctx.group)
        if ctx.on_reduced is not None:
            ctx.on_reduced()  # a SequenceParallelParameter's gradient is whole now
        return grad, None, None


class ReduceFromTensorParallelRegion(Function):
    """g: all-reduce forward (sum the partial outputs), identity backward (every rank
    then holds the same output, so the gradient is already the one each rank needs)."""

    @staticmethod
    def forward(ctx, x, group):
        return dist.all_reduce(x, group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallelRegion(Function):
    """All-gather along the last dim (forward), keep my slice of the gradient
    (backward). Only for looking at full logits (generation); training never gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return dist.all_gather(x, group=group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        width = grad.shape[-1] // ctx.group.size
        start = dist.get_rank(ctx.group) * width
        return np.ascontiguousarray(grad[..., start:start + width]), None


def copy_to_tensor_parallel_region(x: Tensor, group, on_reduced=None) -> Tensor:
    """f (identity forward, all-reduce backward); `on_reduced()` is called after the
    all-reduce (sequence_grads.py's parameters note that their gradient is whole)."""
    return CopyToTensorParallelRegion.apply(x, group, on_reduced)


def reduce_from_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """g (all-reduce forward, identity backward): Partial() in, Replicate() out."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """(..., n/t) split along the last dim -> (..., n) on every rank."""
    return GatherFromTensorParallelRegion.apply(x, group)
