"""Gradient buckets: parameters laid end to end in one flat buffer, the layout data
parallelism and ZeRO share.

DDP reduces a bucket as soon as backward has finished all its gradients (ddp.py); ZeRO
shards it over the data-parallel group, rank r owning the r-th equal piece
(minipar/parallel/zero/). `build_buckets` groups parameters into buckets in reverse
registration order, as DDP's Reducer does (torch/nn/parallel/distributed.py,
`_compute_bucket_assignment_by_size`).
"""

from __future__ import annotations

import numpy as np

from minipar.parallel.booking import hold_buffer


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
        """A flat copy (padded_numel,) of the bucket's gradients for a collective to
        reduce; it lives until the caller releases it (`dist.release`)."""
        grads = [p.grad for p in self.params]
        return hold_buffer(self.flatten(grads, grads[0].dtype))

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
