"""Placements: how a rank's array relates to the full (single-device) tensor.

The vocabulary is PyTorch DTensor's (torch.distributed.tensor):

    Replicate()   every rank of the group holds the whole tensor
    Shard(dim)    the tensor is cut into equal pieces along `dim`; rank i holds piece i
    Partial()     every rank holds a summand; the full tensor is their sum (after an
                  all-reduce / reduce-scatter)
    StridedShard(dim, stride)
                  `dim` is `stride` equal blocks side by side (q | k | v of a fused
                  attention weight); each block is cut as Shard(dim) and rank i holds
                  piece i of every block, concatenated (Megatron-LM's `stride`)

A parallel parameter carries its placement over one group (`param.placement`,
`param.placement_group`, a group kind such as "tp" or "dp"). Consolidation (the
single-device state dict of a parallel run), checkpoint resharding and the sharding
pictures all read placements instead of guessing from shapes.

Activations carry a placement only where one is not whole: `partial(tensor, producer,
reduction)` marks the output of a row-parallel matmul (or a vocabulary-split lookup) as
a `PartialSum`, a Tensor that refuses arithmetic and the fused ops (`require_replicated`)
until the named reduction has summed it. So a forgotten all-reduce is a loud error naming
the layer and the missing collective, instead of a silently wrong loss or gradient.
The check is a type test per op call; a correct run never meets it (the reduction's
output is a plain Tensor). PyTorch DTensor tracks the same thing on every tensor
(`DTensor.placements`) and redistributes implicitly; here a Partial value is only ever
reduced where the code says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.autograd.tensor import Tensor


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class StridedShard:
    """Shard(dim) applied to each of `stride` equal blocks of `dim`, pieces concatenated.

    A column-parallel fused QKV weight (d, 3d) with columns [q | k | v] gives rank i its
    heads' q, k and v columns: [q_i | k_i | v_i] = StridedShard(1, stride=3), which is
    not a contiguous slice of the full matrix (Megatron-LM `ColumnParallelLinear(...,
    stride=3)`; Shoeybi et al. 2019). StridedShard(dim, 1) is Shard(dim).
    """

    dim: int
    stride: int

    def __str__(self) -> str:
        return f"StridedShard({self.dim}, stride={self.stride})"


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __str__(self) -> str:
        return f"Partial({self.reduce_op})"


Placement = Replicate | Shard | StridedShard | Partial


class PlacementError(RuntimeError):
    """A value with the wrong placement was used (e.g. a Partial sum where a replicated
    value is needed: an all-reduce is missing)."""


def shard(full: np.ndarray, placement: Placement, index: int, count: int) -> np.ndarray:
    """The piece of `full` that rank `index` of `count` holds under `placement`."""
    if isinstance(placement, Replicate):
        return full.copy()
    if isinstance(placement, Shard):
        size = full.shape[placement.dim]
        if size % count:
            raise ValueError(f"cannot Shard({placement.dim}) a dimension of size {size} "
                             f"into {count} equal pieces")
        piece = size // count
        cut = [slice(None)] * full.ndim
        cut[placement.dim] = slice(index * piece, (index + 1) * piece)
        return full[tuple(cut)].copy()  # a view of my piece, copied once
    if isinstance(placement, StridedShard):
        blocks = _blocks(full, placement)
        return np.concatenate([shard(b, Shard(placement.dim), index, count) for b in blocks],
                              axis=placement.dim)
    raise PlacementError(f"cannot cut a full tensor into a {placement} placement")


def unshard(pieces: list[np.ndarray], placement: Placement) -> np.ndarray:
    """The full tensor from every rank's piece (in group-rank order)."""
    if isinstance(placement, Replicate):
        return pieces[0].copy()
    if isinstance(placement, Shard):
        return np.concatenate(pieces, axis=placement.dim)
    if isinstance(placement, StridedShard):
        # Block j of the full tensor is the concatenation of block j of every piece.
        per_rank = [_blocks(piece, placement) for piece in pieces]
        return np.concatenate([np.concatenate(column, axis=placement.dim)
                               for column in zip(*per_rank, strict=True)], axis=placement.dim)
    if isinstance(placement, Partial):
        total = pieces[0].copy()
        for piece in pieces[1:]:
            total = total + piece
        return total
    raise TypeError(f"unknown placement {placement!r}")


def _blocks(array: np.ndarray, placement: StridedShard) -> list[np.ndarray]:
    size = array.shape[placement.dim]
    if size % placement.stride:
        raise ValueError(f"cannot cut a dimension of size {size} into {placement.stride} "
                         f"equal blocks for {placement}")
    return np.split(array, placement.stride, axis=placement.dim)


def require_replicated(name: str, placement: Placement) -> None:
    """Refuse a non-replicated value where a replicated one is needed."""
    if not isinstance(placement, Replicate):
        raise PlacementError(f"{name} is {placement} but must be Replicate() here: "
                             "a reduction (all-reduce or all-gather) is missing before it")


def require_replicated_gradients(named_params) -> None:
    """Refuse to read gradients that are still a per-rank summand.

    named_params: (name, parameter) pairs; a parameter's `grad_placement` (minipar.nn.
    Parameter) is Partial() between the backward that accumulated its summand and the
    all-reduce that sums it (sequence parallelism defers that to once per step). The
    optimizers call this before the gradient norm and the step: each replica would
    otherwise step with its own share of the gradient."""
    for name, param in named_params:
        placement = getattr(param, "grad_placement", None)
        if placement is not None and not isinstance(placement, Replicate):
            raise PlacementError(
                f"{name}: its gradient is {placement} over the {param.placement_group} "
                "group (this rank's summand) but the gradient norm and the optimizer "
                "step need Replicate(): the step's all-reduce of the sequence-parallel "
                "gradients (finalize_model_grads, minipar/parallel/tensor/sequence_grads.py) "
                "has not run since the last backward, so each replica would step differently")


# ---------------------------------------------------------------------------- activations
class PartialSum(Tensor):
    """A Tensor holding this rank's summand of a value (placement Partial()): the output
    of a row-parallel matmul before g (all-reduce) or g-bar (reduce-scatter) sums it.

    `producer` names the layer that made it, `reduction` the collective that must come
    next. Only a Function's `apply` (the reduction) may take it; arithmetic with it and
    the fused ops (`functional.py`) raise a PlacementError.
    """

    __slots__ = ("producer", "reduction")

    placement = Partial()

    def refuse(self, consumer: str):
        raise PlacementError(
            f"{consumer} got the output of {self.producer}, which is Partial(sum) (each TP "
            f"rank holds a summand) but must be Replicate() here: the reduction "
            f"{self.reduction} over the tensor-parallel group is missing before it")

    def __add__(self, other):
        self.refuse("an addition (+, e.g. the bias or the residual)")

    __radd__ = __add__

    def __sub__(self, other):
        self.refuse("a subtraction (-)")

    __rsub__ = __sub__

    def __mul__(self, other):
        self.refuse("a multiplication (*)")

    __rmul__ = __mul__

    def __truediv__(self, other):
        self.refuse("a division (/)")

    __rtruediv__ = __truediv__

    def __matmul__(self, other):
        self.refuse("a matmul (@)")

    __rmatmul__ = __matmul__

    def __pow__(self, exponent):
        self.refuse("a power (**)")


def partial(tensor: Tensor, producer: str, reduction: str) -> PartialSum:
    """`tensor` (the same data and graph node) marked Partial(): see `PartialSum`."""
    marked = PartialSum.__new__(PartialSum)  # (Tensor's slots, as tensor._new_tensor sets them)
    marked.data, marked.grad, marked.requires_grad = tensor.data, tensor.grad, tensor.requires_grad
    marked._ctx, marked._index = tensor._ctx, tensor._index
    marked._post_accumulate_grad_hooks = tensor._post_accumulate_grad_hooks
    marked._grad_device = tensor._grad_device
    marked.producer, marked.reduction = producer, reduction
    return marked


def require_reduced(value, consumer: str) -> None:
    """Refuse a Partial activation (a `PartialSum`) where a whole one is needed."""
    if type(value) is PartialSum:
        value.refuse(consumer)
