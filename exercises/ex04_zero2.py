"""Exercise 04: ZeRO's sharded optimizer step (after backward).

Check your work:   python -m exercises.check 04

Data parallelism keeps a full copy of the optimizer state and the gradients on every
rank. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC20; section 5 and figure 1) notices that each rank only needs to
*update* 1/N of the parameters if the ranks then share the results. Stage 2 shards the
Adam moments and the gradients over the N ranks of the data-parallel group:

    1. reduce-scatter the flat gradient: rank i receives only shard i of the average
       (instead of all-reducing the whole gradient)
    2. update shard i of the parameters with AdamW, using shard i of Adam's moments
    3. all-gather the updated shards: every rank has all parameters again

Reduce-scatter + all-gather is exactly how a ring all-reduce works inside (exercise 01),
so ZeRO-2 sends the same bytes as data parallelism, 2(N-1)/N * Ψ * itemsize per rank
(section 7.2.1 of the paper), while each rank holds 1/N of the gradients and 1/N of the
optimizer state. AdamW is elementwise, so updating shards gives *exactly* the numbers of
the replicated optimizer.

The flat layout (given below): all parameters laid end to end (Ψ elements), zero-padded
to Ψ' = a multiple of N, cut into N equal shards; rank i owns [i Ψ'/N, (i+1) Ψ'/N).
DeepSpeed pads its flat partitions the same way.

The memory ledger: minipar measures what each rank holds, by category
(`dist.get_device().memory.hold(array, "optimizer")`). Backward books every p.grad as
"grads"; `p.release_grad()` drops it and its bytes. The checker reads the ledger.

This step runs after backward: until it reduce-scatters, every rank holds the whole
gradient, so the gradient's *peak* is still stage 1's (the checker reads the gradients
after the step, not at their peak). A true stage 2 reduce-scatters during backward, bucket
by bucket: exercise 09.

Write the four TODO methods; `__init__`, `flatten` and `step` are given.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.nn import adamw_update  # noqa: F401 - the AdamW arithmetic, in place on arrays


class Zero2AdamW:
    """AdamW with ZeRO stage 2 over the data-parallel group `group`.

    params: this rank's Parameters, a full replica (every rank runs the whole forward and
    backward on its own data and ends backward with the full p.grad of its data).
    Weight decay applies to matrices only (ndim >= 2), as in minipar.nn.AdamW.
    """

    def __init__(self, params, group, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        # ------------------------------------------------------------ given: the layout
        self.params = list(params)
        self.group = group
        self.world = group.size  # N
        self.rank = dist.get_rank(group)  # my shard's index
        self.lr, self.betas, self.eps = lr, betas, eps
        self.step_count = 0  # AdamW's t, counted from 1 in step()
        self.dtype = self.params[0].dtype
        self.sizes = [p.size for p in self.params]
        self.offsets = [int(o) for o in np.cumsum([0] + self.sizes[:-1])]  # p's place in flat
        self.numel = sum(self.sizes)  # Ψ
        self.padded_numel = -(-self.numel // self.world) * self.world  # Ψ', a multiple of N
        self.shard_numel = self.padded_numel // self.world  # Ψ' / N
        self.start = self.rank * self.shard_numel  # my shard is flat[start:stop]
        self.stop = self.start + self.shard_numel
        decay = self.flatten([np.full(p.shape, weight_decay if p.ndim >= 2 else 0.0)
                              for p in self.params])
        self.weight_decay = decay[self.start:self.stop]  # per element of my shard
        self.memory = dist.get_device().memory  # this rank's ledger
        # ------------------------------------------------------------ yours
        self.exp_avg = None  # Adam's m for my shard: (shard_numel,)
        self.exp_avg_sq = None  # Adam's v for my shard: (shard_numel,)
        self.grad_shard = None  # my shard of the averaged gradient: (shard_numel,)
        self.allocate_state()

    def flatten(self, arrays) -> np.ndarray:
        """One flat (padded_numel,) array: `arrays` (one per parameter, any shapes of the
        parameters') end to end, then zeros up to Ψ'."""
        flat = np.zeros(self.padded_numel, dtype=self.dtype)
        for array, offset, size in zip(arrays, self.offsets, self.sizes, strict=True):
            flat[offset:offset + size] = np.asarray(array).reshape(-1)
        return flat

    def step(self) -> None:
        """One optimizer step, after backward has filled every p.grad (given)."""
        self.step_count += 1
        self.reduce_scatter_gradients()
        shard = self.update_shard()
        self.all_gather_parameters(shard)

    # ---------------------------------------------------------------- TODO 1
    def allocate_state(self) -> None:
        """Allocate my shard's state: exp_avg, exp_avg_sq and grad_shard, each zeros of
        (shard_numel,) and dtype self.dtype, and hold them in the ledger: the moments as
        "optimizer", grad_shard as "grads" (`self.memory.hold(array, category)`).
        The checker reads the ledger: ZeRO-2 keeps 2 Ψ'/N elements of optimizer state
        and Ψ'/N of gradients per rank."""
        raise NotImplementedError("allocate_state: your code here")

    # ---------------------------------------------------------------- TODO 2
    def reduce_scatter_gradients(self) -> None:
        """Flatten every p.grad into one padded array, reduce-scatter it over the group
        with the average (`dist.reduce_scatter(flat, op="avg", group=self.group)`: each
        rank's loss is a mean over its own data), copy the result into self.grad_shard,
        and drop the full gradients with `p.release_grad()`: after this, the rank holds
        only its gradient shard."""
        raise NotImplementedError("reduce_scatter_gradients: your code here")

    # ---------------------------------------------------------------- TODO 3
    def update_shard(self) -> np.ndarray:
        """AdamW on my shard. Take my shard of the flat parameters (a copy), update it in
        place with one call of
            adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                         weight_decay)
        (minipar/nn/optim.py; weight_decay may be the per-element self.weight_decay) and
        return it: the updated (shard_numel,) parameters."""
        raise NotImplementedError("update_shard: your code here")

    # ---------------------------------------------------------------- TODO 4
    def all_gather_parameters(self, shard: np.ndarray) -> None:
        """All-gather the updated shards (`dist.all_gather(shard, group=self.group)`
        returns the (padded_numel,) concatenation in rank order) and write each
        parameter's part back into p.data, in place (`p.data[...] = ...`)."""
        raise NotImplementedError("all_gather_parameters: your code here")
