"""Reference solution of exercise 04: ZeRO's sharded optimizer step (after backward)."""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.nn import adamw_update


class Zero2AdamW:
    """AdamW with ZeRO stage 2 over the data-parallel group `group`."""

    def __init__(self, params, group, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        self.params = list(params)
        self.group = group
        self.world = group.size
        self.rank = dist.get_rank(group)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.step_count = 0
        self.dtype = self.params[0].dtype
        self.sizes = [p.size for p in self.params]
        self.offsets = [int(o) for o in np.cumsum([0] + self.sizes[:-1])]
        self.numel = sum(self.sizes)
        self.padded_numel = -(-self.numel // self.world) * self.world
        self.shard_numel = self.padded_numel // self.world
        self.start = self.rank * self.shard_numel
        self.stop = self.start + self.shard_numel
        decay = self.flatten([np.full(p.shape, weight_decay if p.ndim >= 2 else 0.0)
                              for p in self.params])
        self.weight_decay = decay[self.start:self.stop]
        self.memory = dist.get_device().memory
        self.exp_avg = None
        self.exp_avg_sq = None
        self.grad_shard = None
        self.allocate_state()

    def flatten(self, arrays) -> np.ndarray:
        flat = np.zeros(self.padded_numel, dtype=self.dtype)
        for array, offset, size in zip(arrays, self.offsets, self.sizes, strict=True):
            flat[offset:offset + size] = np.asarray(array).reshape(-1)
        return flat

    def step(self) -> None:
        self.step_count += 1
        self.reduce_scatter_gradients()
        shard = self.update_shard()
        self.all_gather_parameters(shard)

    def allocate_state(self) -> None:
        self.exp_avg = np.zeros(self.shard_numel, self.dtype)
        self.exp_avg_sq = np.zeros(self.shard_numel, self.dtype)
        self.grad_shard = np.zeros(self.shard_numel, self.dtype)
        self.memory.hold(self.exp_avg, "optimizer")
        self.memory.hold(self.exp_avg_sq, "optimizer")
        self.memory.hold(self.grad_shard, "grads")

    def reduce_scatter_gradients(self) -> None:
        flat = self.flatten([p.grad for p in self.params])
        self.grad_shard[...] = dist.reduce_scatter(flat, op="avg", group=self.group)
        for p in self.params:
            p.release_grad()  # only my shard of the gradient stays

    def update_shard(self) -> np.ndarray:
        shard = self.flatten([p.data for p in self.params])[self.start:self.stop].copy()
        beta1, beta2 = self.betas
        adamw_update(shard, self.grad_shard, self.exp_avg, self.exp_avg_sq, self.step_count,
                     self.lr, beta1, beta2, self.eps, self.weight_decay)
        return shard

    def all_gather_parameters(self, shard: np.ndarray) -> None:
        flat = dist.all_gather(shard, group=self.group)
        for p, offset, size in zip(self.params, self.offsets, self.sizes, strict=True):
            p.data[...] = flat[offset:offset + size].reshape(p.shape)
