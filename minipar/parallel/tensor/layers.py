"""Megatron's tensor-parallel linear layers, from one rank's point of view (Shoeybi et
al. 2019, section 3; Megatron-LM's `megatron/core/tensor_parallel/layers.py`).

A matmul Y = X A splits two ways over the t ranks of a TP group:

    column-parallel  A = [A_1 | ... | A_t]      Y_i = X A_i        (Y comes out split)
    row-parallel     A = [A_1; ...; A_t]        Y = sum_i X_i A_i  (X goes in split)

Column then row needs no communication in between; f before the column-parallel layer
and g after the row-parallel one (mappings.py) are the only collectives. With sequence
parallelism the column-parallel input is all-gathered inside `sequence_parallel_linear`
and g becomes a reduce-scatter (sequence.py).

A row-parallel matmul's output is Partial(): each rank holds its rows' share of the sum.
`RowParallelLinear` marks it so (`placement.partial`), and until g or g-bar has summed
it, adding the bias, the residual or feeding it to another op raises a PlacementError
naming this layer and the missing reduction (DESIGN.md's placement promise).
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
    reduce_scatter_to_sequence_parallel_region,
)
from minipar.parallel.tensor.sequence import (
    copy_parameter_to_tensor_parallel_region,
    sequence_parallel_linear,
    sequence_parallel_parameter,
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

    x: (B, T, in) replicated (or (B, T/t, in) with sequence parallelism) ->
    (B, T, out/t). `stride` > 1 splits each of `stride` column blocks separately: the
    fused c_attn (d, 3d) = [q | k | v] uses stride 3, so rank i holds [q_i | k_i | v_i]
    of its heads (placement StridedShard(1, 3)).
    """

    def __init__(self, weight: Parameter, bias: Parameter | None, group, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel

    @classmethod
    def from_linear(cls, linear: Linear, group, *, stride: int = 1,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """My columns of a full `Linear`."""
        width = linear.weight.shape[1]
        what = "the output width" if stride == 1 else f"each of the {stride} column blocks"
        check_divisible(what, width // stride, group.size)
        weight_placement = Shard(1) if stride == 1 else StridedShard(1, stride)
        bias_placement = Shard(0) if stride == 1 else StridedShard(0, stride)
        weight = shard_parameter(linear.weight.data, weight_placement, group)
        bias = None if linear.bias is None else shard_parameter(linear.bias.data,
                                                              bias_placement, group)
        return cls(weight, bias, group, sequence_parallel=sequence_parallel)

    def forward(self, x):
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(Module):
    """Y = sum_i X_i A_i + b: the weight (in, out) split by rows, X comes in split.

    x: (B, T, in/t) -> (B, T, out) replicated, or (B, T/t, out) with sequence
    parallelism (reduce-scatter instead of all-reduce). The bias is replicated and added
    once, after the reduction. `name` (set by `parallelize_tensor`, e.g.
    "h.0.attn.c_proj") names the layer in placement errors.
    """

    def __init__(self, weight: Parameter, bias: Parameter | None, group, *,
                 sequence_parallel: bool = False, name: str = "RowParallelLinear"):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel
        self.name = name

    @classmethod
    def from_linear(cls, linear: Linear, group, *, sequence_parallel: bool = False,
                    name: str = "RowParallelLinear") -> RowParallelLinear:
        """My rows of a full `Linear`; the bias is replicated (with sequence parallelism
        it sees only my tokens: a `SequenceParallelParameter`)."""
        check_divisible("the input width", linear.weight.shape[0], group.size)
        weight = shard_parameter(linear.weight.data, Shard(0), group)
        bias = None
        if linear.bias is not None:
            bias = shard_parameter(linear.bias.data, Replicate(), group)
            if sequence_parallel:
                bias = sequence_parallel_parameter(bias, f"{name}.bias")
        return cls(weight, bias, group, sequence_parallel=sequence_parallel, name=name)

    def forward(self, x):
        if self.sequence_parallel:
            # My rows' share of the sum, awaiting g-bar (reduce-scatter over TP).
            y = reduce_scatter_to_sequence_parallel_region(
                partial(F.linear(x, self.weight), self.name,
                        "g-bar (reduce_scatter_to_sequence_parallel_region)"), self.group)
        else:
            # My rows' share of the sum, awaiting g (all-reduce over TP).
            y = reduce_from_tensor_parallel_region(
                partial(F.linear(x, self.weight), self.name,
                        "g (reduce_from_tensor_parallel_region)"), self.group)
        if self.bias is None:
            return y
        bias = self.bias
        if self.sequence_parallel:
            # The bias meets only my tokens: its gradient is a partial sum (f sums it, or
            # the step does once it is deferred: sequence.py).
            bias = copy_parameter_to_tensor_parallel_region(bias, self.group)
        return y + bias


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "check_divisible", "shard_parameter"]
