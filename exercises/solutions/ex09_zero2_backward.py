"""Reference solution of exercise 09: ZeRO-2, reduce-scattering during backward."""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist


class Zero2Gradients:
    """ZeRO-2's gradient partitioning over the data-parallel group `group`."""

    def __init__(self, buckets, group):
        self.buckets = [list(bucket) for bucket in buckets]
        self.group = group
        self.world = group.size
        self.rank = dist.get_rank(group)
        self.sizes = [[p.size for p in bucket] for bucket in self.buckets]
        self.numel = [sum(sizes) for sizes in self.sizes]
        self.padded_numel = [-(-n // self.world) * self.world for n in self.numel]
        self.shard_numel = [n // self.world for n in self.padded_numel]
        self.dtype = self.buckets[0][0].dtype
        self.ready = [0] * len(self.buckets)
        self.grad_shards = [None] * len(self.buckets)
        self.register_hooks()

    def flatten(self, b: int, arrays) -> np.ndarray:
        flat = np.zeros(self.padded_numel[b], dtype=self.dtype)
        offset = 0
        for array, size in zip(arrays, self.sizes[b], strict=True):
            flat[offset:offset + size] = np.asarray(array).reshape(-1)
            offset += size
        return flat

    def zero_grad(self) -> None:
        for shard in self.grad_shards:
            if shard is not None:
                dist.release(shard)
        self.grad_shards = [None] * len(self.buckets)

    def register_hooks(self) -> None:
        for b, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self.on_gradient_ready(b))

    def on_gradient_ready(self, b: int) -> None:
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            self.ready[b] = 0
            self.reduce_bucket(b)

    def reduce_bucket(self, b: int) -> None:
        flat = self.flatten(b, [p.grad for p in self.buckets[b]])
        piece = dist.reduce_scatter(flat, op="avg", group=self.group)
        for p in self.buckets[b]:
            p.release_grad()  # only my piece of this bucket stays
        if self.grad_shards[b] is None:
            self.grad_shards[b] = dist.hold(piece, "grads")
        else:
            self.grad_shards[b] += piece
