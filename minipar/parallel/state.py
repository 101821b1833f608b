"""What a gradient engine holds, read from any engine (DDP, ZeRO-1/2/3, offloaded, the
expert pair): the views its readers need, written once.

    parameter_pieces(engine)   the parameter values this rank holds: the report's
                               consolidation, `--check`, the divergence check
    state_pieces(engine)       what this rank alone must save: its parameters and
                               optimizer state, for a sharded checkpoint
    holdings(engine)           every range of every tensor it keeps, with live arrays
                               (minipar/viz/sharding.py draws them)
    describe(engine)           how its state is laid out (the report's
                               ranks[i]["sharding"])

A `Piece` or `Holding` is a flat range [start, stop) of one tensor as this rank holds
it: the whole local tensor for a replica (DDP, ZeRO-1/2's parameters), the part of it
that falls in my shard of a flat bucket otherwise (`Bucket.overlaps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.autograd.placement import Placement, Replicate
from minipar.parallel.data.buckets import Bucket
from minipar.parallel.data.ddp import DataParallel
from minipar.parallel.expert.engine import ExpertDataParallel
from minipar.parallel.zero.offload import ZeroOffload
from minipar.parallel.zero.stage3 import Zero3Optimizer


@dataclass(frozen=True)
class Piece:
    """A flat range of one tensor of the training state, as one rank holds it.

    kind: "param" | "exp_avg" | "exp_avg_sq" | "master"; name: the parameter's name
    (Hugging Face GPT-2's); shape: the rank's local tensor (the full tensor unless tensor
    parallelism cut it); start, stop: the range of the flattened local tensor held;
    values: (stop - start,) array; placement, placement_group: how the local tensor
    relates to the full one (the parameter's, see autograd/placement.py).
    """

    kind: str
    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    values: np.ndarray
    placement: Placement = Replicate()
    placement_group: str | None = None


@dataclass(frozen=True)
class Holding:
    """A flat range of one tensor of the training state that a rank keeps. As `Piece`,
    with kind also "grad"; dtype of the elements; bucket, flat_start: the flat buffer and
    the flat position of `start` (None: the tensor is its own array); values: the live
    (stop - start,) array, None while it does not exist (DP / ZeRO-1 gradients between
    backward passes)."""

    kind: str
    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    dtype: np.dtype
    bucket: int | None = None
    flat_start: int | None = None
    placement: Placement = Replicate()
    placement_group: str | None = None
    values: np.ndarray | None = None

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize


# ------------------------------------------------------------------ the four views
def parameter_pieces(engine) -> list[Piece]:
    """The parameter values this rank holds: its whole replica (DDP, ZeRO-1/2), or its
    shard of every unit (ZeRO-3, the only parameters it keeps between uses)."""
    if isinstance(engine, ExpertDataParallel):
        return [p for part in engine.engines for p in parameter_pieces(part)]
    if isinstance(engine, Zero3Optimizer):
        return [piece for sb in engine.shards
                for piece in bucket_pieces(sb.bucket, "param", sb.param_shard, engine.rank)]
    return [_whole_piece("param", name, p.data, p) for name, p in _named(engine)]


def state_pieces(engine) -> list[Piece]:
    """Parameters and optimizer state this rank alone holds, for a checkpoint: a DDP
    replica its whole copy (every replica saves its own), a ZeRO rank its shard of the
    parameters, of the master weights and of Adam's moments."""
    if isinstance(engine, ExpertDataParallel):
        return [p for part in engine.engines for p in state_pieces(part)]
    if isinstance(engine, DataParallel):
        pieces = parameter_pieces(engine)
        for name, p, master, m, v in _adamw_states(engine):
            pieces += [_whole_piece("exp_avg", name, m, p), _whole_piece("exp_avg_sq", name, v, p)]
            if master is not None:
                pieces.append(_whole_piece("master", name, master, p))
        return pieces
    pieces = []
    for sb in engine.shards:
        for kind, array in (("param", sb.param_shard), *sb.optimizer_states()):
            pieces += bucket_pieces(sb.bucket, kind, array, engine.rank)
    return pieces


def holdings(engine) -> list[Holding]:
    """What this rank keeps of every tensor, per parameter: the parameters, the gradient
    (a ZeRO-2/3 rank its shard, DDP and ZeRO-1 the whole local p.grad) and each optimizer
    state (a ZeRO rank its shard)."""
    if isinstance(engine, ExpertDataParallel):
        return [h for part in engine.engines for h in holdings(part)]
    if isinstance(engine, DataParallel):
        held = []
        for name, p, master, m, v in _adamw_states(engine):
            held += [_whole_holding("param", name, p, p.data),
                     _whole_holding("grad", name, p, p.grad, p.dtype)]
            if master is not None:
                held.append(_whole_holding("master", name, p, master))
            held += [_whole_holding("exp_avg", name, p, m),
                     _whole_holding("exp_avg_sq", name, p, v)]
        return held
    held, rank, dtype = [], engine.rank, engine.param_dtype
    for sb in engine.shards:
        bucket = sb.bucket
        if isinstance(engine, Zero3Optimizer):
            held += bucket_holdings(bucket, "param", rank, dtype, sb.param_shard)
        else:
            held += [Holding("param", name, p.shape, 0, p.size, np.dtype(dtype), bucket.index,
                             offset, p.placement, p.placement_group, p.data.reshape(-1))
                     for name, p, offset in zip(bucket.names, bucket.params, bucket.offsets,
                                                strict=True)]
        if engine.partition_gradients:
            held += bucket_holdings(bucket, "grad", rank, dtype, sb.grad_shard)
        else:
            held += [Holding("grad", name, p.shape, 0, p.size, np.dtype(dtype),
                             placement=p.placement, placement_group=p.placement_group,
                             values=None if p.grad is None else p.grad.reshape(-1))
                     for name, p in zip(bucket.names, bucket.params, strict=True)]
        for kind, array in sb.optimizer_states():
            held += bucket_holdings(bucket, kind, rank, array.dtype, array)
    return held


def describe(engine) -> dict:
    """How this rank's state is laid out (the report's ranks[i]["sharding"]): the ZeRO
    stage, its buckets, elements with and without padding, and for ZeRO the shard size
    and the offload devices. The expert pair adds both engines' buckets and elements."""
    if isinstance(engine, ExpertDataParallel):
        dense, *experts = (describe(part) for part in engine.engines)
        experts = experts[0] if experts else {}  # (none on a stage without MoE layers)
        merged = dict(dense)
        for key in ("buckets", "numel", "padded_numel", "padding_elements"):
            if key in experts:
                merged[key] = dense.get(key, 0) + experts[key]
        merged["expert_numel"] = experts.get("numel", 0)
        return merged
    if isinstance(engine, DataParallel):
        numel = sum(p.size for p in engine.params)
        return {"zero_stage": 0, "buckets": len(engine.buckets), "numel": numel,
                "padded_numel": numel, "padding_elements": 0}
    numel = sum(sb.bucket.numel for sb in engine.shards)
    padded = sum(sb.bucket.padded_numel for sb in engine.shards)
    offloaded = isinstance(engine, ZeroOffload)
    return {"zero_stage": engine.stage, "buckets": len(engine.shards), "numel": numel,
            "padded_numel": padded, "padding_elements": padded - numel,
            "shard_numel": padded // engine.world,
            "offload_optimizer": engine.offload_optimizer if offloaded else "none",
            "offload_param": engine.offload_param if offloaded else "none"}


# ------------------------------------------------------------------ flat buckets
def bucket_pieces(bucket: Bucket, kind: str, flat_shard: np.ndarray, shard: int) -> list[Piece]:
    """The Pieces that `flat_shard` (shard `shard` of a flat buffer of `bucket`) holds."""
    start, stop = bucket.shard_range(shard)
    return [Piece(kind, bucket.names[i], bucket.shapes[i], lo, hi,
                  flat_shard[flat_lo - start:flat_hi - start],
                  bucket.params[i].placement, bucket.params[i].placement_group)
            for i, lo, hi, flat_lo, flat_hi in bucket.overlaps(start, stop)]


def bucket_holdings(bucket: Bucket, kind: str, shard: int, dtype,
                    flat_shard=None) -> list[Holding]:
    """What shard `shard` of a flat buffer of `bucket` holds, per parameter
    (`flat_shard`: its live (shard_numel,) array, if any)."""
    start, stop = bucket.shard_range(shard)
    return [Holding(kind, bucket.names[i], bucket.shapes[i], lo, hi, np.dtype(dtype),
                    bucket.index, flat_lo, bucket.params[i].placement,
                    bucket.params[i].placement_group,
                    None if flat_shard is None else flat_shard[flat_lo - start:flat_hi - start])
            for i, lo, hi, flat_lo, flat_hi in bucket.overlaps(start, stop)]


def _named(engine):
    """(name, Parameter) of a replica: DDP's in registration order, ZeRO-1/2's bucket by
    bucket."""
    if isinstance(engine, DataParallel):
        return zip(engine.names, engine.params, strict=True)
    return ((name, p) for sb in engine.shards
            for name, p in zip(sb.bucket.names, sb.bucket.params, strict=True))


def _adamw_states(engine: DataParallel):
    opt = engine.optimizer
    return zip(engine.names, engine.params, opt.master, opt.exp_avg, opt.exp_avg_sq,
               strict=True)


def _whole_piece(kind: str, name: str, array: np.ndarray, param) -> Piece:
    return Piece(kind, name, array.shape, 0, array.size, array.reshape(-1),
                 param.placement, param.placement_group)


def _whole_holding(kind: str, name: str, param, array, dtype=None) -> Holding:
    values, dtype = (None, dtype) if array is None else (array.reshape(-1), array.dtype)
    return Holding(kind, name, param.shape, 0, param.size, np.dtype(dtype),
                   placement=param.placement, placement_group=param.placement_group,
                   values=values)
