"""The flat layout data parallelism and ZeRO share: parameters laid end to end in buckets.

`Bucket` is a flat layout of parameters padded to a multiple of the group size: the unit
DDP reduces while backward goes on (data.py) and the unit ZeRO shards (zero_engine.py);
`build_buckets` groups parameters into buckets in reverse registration order, as DDP's
Reducer does. `Piece` is how the engines describe what a rank holds to checkpoints and
equivalence checks, `Holding` (`engine.holdings()`) to readers such as the sharding
pictures. (They lived in data.py until issue 15; data.py still re-exports them.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.autograd.placement import Placement, Replicate


@dataclass(frozen=True)
class Piece:
    """A flat range of one tensor of the training state, as one rank holds it.

    kind: "param" | "exp_avg" | "exp_avg_sq" | "master"; name: the parameter's name
    (DESIGN.md's Hugging Face names); shape: the rank's local tensor (the full tensor
    unless tensor parallelism cut it); start, stop: the range of the flattened local
    tensor held; values: (stop - start,) array; placement, placement_group: how the
    local tensor relates to the full one (the parameter's, see autograd/placement.py).
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
    """A flat range of one tensor of the training state that a rank keeps, as
    `engine.holdings()` describes it (minipar/viz/sharding.py draws it). As `Piece`, with
    kind also "grad"; dtype of the elements; bucket, flat_start: the flat buffer and the
    flat position of `start` (None: the tensor is its own array); values: the live
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


class Bucket:
    """Parameters laid end to end in one flat buffer of `padded_numel` elements.

    Parameter i occupies flat[offsets[i] : offsets[i] + sizes[i]]. The tail is zero
    padding up to a multiple of `shards` (the DP size), so the buffer splits into equal
    pieces of `shard_numel` for reduce-scatter and all-gather (ZeRO; DeepSpeed pads its
    flat partitions the same way). For plain DP, shards = 1 and there is no padding.
    """

    def __init__(self, index: int, named_params: list, shards: int):
        self.index = index
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.size for p in self.params]
        self.offsets = list(np.cumsum([0] + self.sizes[:-1]).tolist())
        self.numel = sum(self.sizes)
        self.shards = shards
        self.padded_numel = -(-self.numel // shards) * shards  # round up
        self.shard_numel = self.padded_numel // shards
        self.ready = 0  # gradients completed in the running backward

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def flatten(self, arrays, dtype) -> np.ndarray:
        """One padded flat array (padded_numel,) from one array per parameter."""
        parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
        if self.padding:
            parts.append(np.zeros(self.padding, dtype=dtype))
        return np.concatenate(parts)

    def flatten_grads(self) -> np.ndarray:
        grads = [p.grad for p in self.params]
        return self.flatten(grads, grads[0].dtype)

    def view(self, flat: np.ndarray, i: int) -> np.ndarray:
        """Parameter i's part of a flat buffer, shaped like the parameter (a view)."""
        return flat[self.offsets[i]:self.offsets[i] + self.sizes[i]].reshape(self.shapes[i])

    def shard_range(self, shard: int) -> tuple[int, int]:
        """[start, stop) of shard `shard` in the flat buffer."""
        return shard * self.shard_numel, (shard + 1) * self.shard_numel

    def overlaps(self, start: int, stop: int):
        """The parameters that overlap flat[start:stop], as
        (i, first element in parameter i, last + 1, same range in flat coordinates)."""
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                yield i, lo - offset, hi - offset, lo, hi

    def holdings(self, kind: str, shard: int, dtype, flat_shard=None) -> list[Holding]:
        """What shard `shard` of a flat buffer of this bucket holds, per parameter
        (`flat_shard`: its live (shard_numel,) array, if any)."""
        start, stop = self.shard_range(shard)
        return [Holding(kind, self.names[i], self.shapes[i], lo, hi, np.dtype(dtype),
                        self.index, flat_lo, self.params[i].placement,
                        self.params[i].placement_group,
                        None if flat_shard is None else flat_shard[flat_lo - start:
                                                                   flat_hi - start])
                for i, lo, hi, flat_lo, flat_hi in self.overlaps(start, stop)]

    def whole_holdings(self, kind: str, arrays, dtype) -> list[Holding]:
        """Every parameter of the bucket whole (a replica), at its place in the flat
        buffer; arrays: one live array per parameter (or None)."""
        return [Holding(kind, name, p.shape, 0, p.size, np.dtype(dtype), self.index, offset,
                        p.placement, p.placement_group,
                        None if a is None else a.reshape(-1))
                for name, p, offset, a in zip(self.names, self.params, self.offsets, arrays,
                                              strict=True)]

    def pieces(self, kind: str, flat_shard: np.ndarray, shard: int) -> list[Piece]:
        """The Pieces that `flat_shard` (this rank's shard of a flat buffer) holds."""
        start, stop = self.shard_range(shard)
        return [Piece(kind, self.names[i], self.shapes[i], lo, hi,
                      flat_shard[flat_lo - start:flat_hi - start],
                      self.params[i].placement, self.params[i].placement_group)
                for i, lo, hi, flat_lo, flat_hi in self.overlaps(start, stop)]


def build_buckets(named_params: list, bucket_bytes: float, shards: int) -> list[Bucket]:
    """Group parameters into buckets of at most `bucket_bytes` (a parameter larger than
    that gets a bucket of its own), in reverse registration order like DDP: backward
    finishes the last layers' gradients first. bucket_bytes <= 0: one bucket of all."""
    ordered = list(reversed(named_params))
    if bucket_bytes <= 0:
        return [Bucket(0, ordered, shards)]
    groups, current, size = [], [], 0
    for name, p in ordered:
        if current and size + p.data.nbytes > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.data.nbytes
    groups.append(current)
    return [Bucket(i, group, shards) for i, group in enumerate(groups)]
