"""The communication at the edges of tensor-parallel and sequence-parallel regions.

Each function is an autograd op whose forward and backward are a collective (or nothing)
over the TP group, so a layer says *where* its data changes placement and the backward
pass gets the conjugate communication for free. Names and pairing follow Megatron-LM's
`megatron/core/tensor_parallel/mappings.py` (picotron keeps the same idea apart from
its layers in `picotron/tensor_parallel/tp_communications.py`); the layers that use them
are in tensor_layers.py, vocab.py and sequence.py.

Tensor parallelism (Shoeybi et al. 2019, figure 3), replicated <-> split:

    copy_to_tensor_parallel_region       f: identity forward, all-reduce backward
    reduce_from_tensor_parallel_region   g: all-reduce forward, identity backward
    gather_from_tensor_parallel_region   all-gather the last dim forward, keep my slice
                                         of the gradient backward (full logits, for
                                         generation only)

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2 and figure 6), the
sequence-split region (B, T/t, ...) <-> the tensor-parallel region (B, T, ...):

    scatter_to_sequence_parallel_region        keep my tokens forward (free),
                                               all-gather backward
    gather_from_sequence_parallel_region       all-gather forward, reduce-scatter
                                               backward (the paper's g; or, for a
                                               replicated consumer such as an MoE
                                               layer, keep my piece of the gradient)
    reduce_scatter_to_sequence_parallel_region reduce-scatter forward, all-gather
                                               backward (the paper's g-bar)

An all-reduce is a reduce-scatter followed by an all-gather, so g-bar then g moves the
bytes of one all-reduce. Activations are (B, T, ...) here (Megatron uses (T, B, ...)),
so the sequence is dim 1.

Placements (minipar.autograd.placement): a row-parallel matmul's output is Partial()
until g or g-bar sums it. Every Tensor that leaves g, g-bar or an all-gather is
replicated (or sequence-sharded) again; `Partial` values are marked by the layers that
make them (tensor_layers.RowParallelLinear), and `require_replicated` refuses them where
a whole value is needed, so a forgotten reduction is a loud error.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.function import Function
from minipar.autograd.tensor import Tensor

SEQUENCE_DIM = 1  # activations are (B, T, ...)


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
    all-reduce (sequence.py's parameters note that their gradient is whole)."""
    return CopyToTensorParallelRegion.apply(x, group, on_reduced)


def reduce_from_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """g (all-reduce forward, identity backward): Partial() in, Replicate() out."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """(..., n/t) split along the last dim -> (..., n) on every rank."""
    return GatherFromTensorParallelRegion.apply(x, group)


# ---------------------------------------------------------------------------- SP regions
def my_sequence_piece(x: np.ndarray, group) -> np.ndarray:
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
