"""Megatron's tensor-parallel linear layers, from one rank's point of view (Shoeybi et
al. 2019, section 3; Megatron-LM's `megatron/core/tensor_parallel/layers.py`).

A matmul Y = X A splits two ways over the t ranks of a TP group:

    column-parallel  A = [A_1 | ... | A_t]      Y_i = X A_i        (Y comes out split)
    row-parallel     A = [A_1; ...; A_t]        Y = sum_i X_i A_i  (X goes in split)

Column then row needs no communication in between; f before the column-parallel layer
and g after the row-parallel one (mappings.py) are the only collectives. Sequence
parallelism's versions, entered from and leaving a sequence piece, are in sequence.py.

A row-parallel matmul's output is Partial(): each rank holds its rows' share of the sum.
`RowParallelLinear` marks it so (`placement.partial`), and until g has summed it, adding
the bias, the residual or feeding it to another op raises a PlacementError naming this
layer and the missing reduction.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd import functional as F
from minipar.autograd.placement import Replicate, Shard, StridedShard, partial, shard
from minipar.nn import Linear, Module, Parameter
from minipar.parallel.tensor.mappings import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)


def shard_parameter(full: np.ndarray, placement, group) -> Parameter:
    """A Parameter holding my piece of `full` under `placement` over the TP group."""
    piece = shard(full, placement, dist.get_rank(group), group.size)
    return Parameter(piece, placement=placement, placement_group="tp")


def check_divisible(what: str, size: int, t: int) -> None:
    if size % t:
        raise ValueError(f"tensor parallelism: {what} ({size}) is not divisible by --tp {t}; "
                         f"choose --tp among {[d for d in range(1, size + 1) if size % d == 0]}")


class ColumnParallelLinear(Module):
    """Y_i = X A_i + b_i: the weight (in, out) split by columns, Y comes out split.

    x: (B, T, in) replicated -> (B, T, out/t). `stride` > 1 splits each of `stride`
    column blocks separately: the fused c_attn (d, 3d) = [q | k | v] uses stride 3, so
    rank i holds [q_i | k_i | v_i] of its heads (placement StridedShard(1, 3)).
    """

    def __init__(self, weight: Parameter, bias: Parameter | None, group):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    @classmethod
    def from_linear(cls, linear: Linear, group, *, stride: int = 1):
        """My columns of a full `Linear`."""
        width = linear.weight.shape[1]
        what = "the output width" if stride == 1 else f"each of the {stride} column blocks"
        check_divisible(what, width // stride, group.size)
        weight_placement = Shard(1) if stride == 1 else StridedShard(1, stride)
        bias_placement = Shard(0) if stride == 1 else StridedShard(0, stride)
        weight = shard_parameter(linear.weight.data, weight_placement, group)
        bias = None if linear.bias is None else shard_parameter(linear.bias.data,
                                                              bias_placement, group)
        return cls(weight, bias, group)

    def forward(self, x):
        return F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(Module):
    """Y = sum_i X_i A_i + b: the weight (in, out) split by rows, X comes in split.

    x: (B, T, in/t) -> (B, T, out) replicated. The bias is replicated and added once,
    after the reduction. `name` (e.g. "h.0.attn.c_proj") names the layer in placement
    errors.
    """

    def __init__(self, weight: Parameter, bias: Parameter | None, group, *,
                 name: str = "RowParallelLinear"):
        super().__init__()
        self.weight, self.bias, self.group, self.name = weight, bias, group, name

    @classmethod
    def from_linear(cls, linear: Linear, group, *, name: str = "RowParallelLinear"):
        """My rows of a full `Linear`; the bias is replicated."""
        check_divisible("the input width", linear.weight.shape[0], group.size)
        weight = shard_parameter(linear.weight.data, Shard(0), group)
        bias = None
        if linear.bias is not None:
            bias = shard_parameter(linear.bias.data, Replicate(), group)
        return cls(weight, bias, group, name=name)

    def forward(self, x):
        # My rows' share of the sum, awaiting g (all-reduce over TP).
        y = reduce_from_tensor_parallel_region(
            partial(F.linear(x, self.weight), self.name,
                    "g (reduce_from_tensor_parallel_region)"), self.group)
        return y if self.bias is None else y + self.bias
