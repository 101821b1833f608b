"""Exercise 09: a true ZeRO-2, reduce-scattering gradients during backward.

Check your work:   python -m exercises.check 09

Exercise 04 reduce-scatters the gradient in the optimizer step, *after* backward: at the
end of backward every rank still holds the whole gradient, Ψ elements, and ZeRO-2's
promise, "1/N of the gradients", holds only after the step. The gradient's *peak* is
then stage 1's. ZeRO stage 2 (Rajbhandari et al. 2020, section 5.2, "P_os+g") keeps the
peak down by reducing as backward goes: the gradients are laid out in buckets, and as
soon as backward has finished every gradient of a bucket, the bucket is reduce-scattered
and its full gradients are dropped. Only one bucket's full gradients (plus the shards)
ever exist. DeepSpeed does this in `reduce_independent_p_g_buckets_and_remove_grads`
(deepspeed/runtime/zero/stage_1_and_2.py), Megatron-LM's distributed optimizer with
`overlap_grad_reduce` (megatron/core/distributed/param_and_grad_buffer.py), FSDP in its
post-backward hook.

With gradient accumulation, ZeRO-2 has no full gradient to accumulate into: it
reduce-scatters after *every* micro-batch and adds the reduced piece into its shard. So
ZeRO-2 moves A times ZeRO-1's reduce-scatter bytes per step: the trade DeepSpeed states
for stage 2 with accumulation.

The hook: `p.register_post_accumulate_grad_hook(hook)` calls `hook(p)` once backward has
finished p's gradient of this backward pass (minipar/autograd/tensor.py, as
torch.Tensor.register_post_accumulate_grad_hook). `p.release_grad()` drops p.grad and
its bytes from the memory ledger (backward books every p.grad as "grads").

The layout (given): one bucket per layer, in the order backward finishes them (the last
layer first); each bucket's parameters laid end to end, zero-padded to a multiple of N;
rank i owns the i-th of the N equal pieces of every bucket.

Write the three TODO methods; `__init__`, `flatten` and `zero_grad` are given.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist


class Zero2Gradients:
    """ZeRO-2's gradient partitioning over the data-parallel group `group`.

    buckets: lists of this rank's Parameters (a full replica: every rank runs the whole
    forward and backward on its own data), one list per bucket, in the order backward
    completes them. After each micro-batch's backward, self.grad_shards[b] holds this
    rank's piece of bucket b's gradient averaged over the ranks and summed over the
    micro-batches so far (the training loop scales each micro-batch's loss by 1/A).
    """

    def __init__(self, buckets, group):
        # ------------------------------------------------------------ given: the layout
        self.buckets = [list(bucket) for bucket in buckets]
        self.group = group
        self.world = group.size  # N
        self.rank = dist.get_rank(group)  # my piece's index
        self.sizes = [[p.size for p in bucket] for bucket in self.buckets]
        self.numel = [sum(sizes) for sizes in self.sizes]  # per bucket
        self.padded_numel = [-(-n // self.world) * self.world for n in self.numel]
        self.shard_numel = [n // self.world for n in self.padded_numel]
        self.dtype = self.buckets[0][0].dtype
        # ------------------------------------------------------------ yours
        self.ready = [0] * len(self.buckets)  # gradients finished in this backward
        self.grad_shards = [None] * len(self.buckets)  # (shard_numel[b],) each, or None
        self.register_hooks()

    def flatten(self, b: int, arrays) -> np.ndarray:
        """One flat (padded_numel[b],) array: `arrays` (one per parameter of bucket b)
        end to end, then zeros."""
        flat = np.zeros(self.padded_numel[b], dtype=self.dtype)
        offset = 0
        for array, size in zip(arrays, self.sizes[b], strict=True):
            flat[offset:offset + size] = np.asarray(array).reshape(-1)
            offset += size
        return flat

    def zero_grad(self) -> None:
        """After the optimizer step (given): drop the gradient shards."""
        for shard in self.grad_shards:
            if shard is not None:
                dist.release(shard)
        self.grad_shards = [None] * len(self.buckets)

    # ---------------------------------------------------------------- TODO 1
    def register_hooks(self) -> None:
        """Register, on every parameter of every bucket b, a post-accumulate-grad hook
        that calls self.on_gradient_ready(b). (Mind Python's late binding in a loop:
        `lambda p, b=b: ...` keeps each bucket's own b.)"""
        raise NotImplementedError("register_hooks: your code here")

    # ---------------------------------------------------------------- TODO 2
    def on_gradient_ready(self, b: int) -> None:
        """Count bucket b's finished gradients; when the last one of the bucket is done,
        reset the count (the next micro-batch counts again) and reduce the bucket."""
        raise NotImplementedError("on_gradient_ready: your code here")

    # ---------------------------------------------------------------- TODO 3
    def reduce_bucket(self, b: int) -> None:
        """Flatten bucket b's gradients, reduce-scatter them over the group with the
        average (`dist.reduce_scatter(flat, op="avg", group=self.group)` returns my
        piece), drop the full gradients (`p.release_grad()`), and accumulate the piece:
        the micro-batch's first reduction becomes self.grad_shards[b], held in the
        ledger as "grads" (`dist.hold(piece, "grads")`); later ones are added into it."""
        raise NotImplementedError("reduce_bucket: your code here")
