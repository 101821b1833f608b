"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC20, sections 5.1-5.2; DeepSpeed's
`runtime/zero/stage_1_and_2.py`). What the stages share (flat shards, the gradient
reduce-scatter, AdamW on my shard) is `ZeroEngine` in sharded.py; stage 3 is
`Zero3Optimizer` in stage3.py.

Data parallelism keeps the whole model state on every rank: with mixed precision 2Ψ bytes
of bf16 parameters, 2Ψ of bf16 gradients and 12Ψ of optimizer state (fp32 master weights,
Adam m and v) for Ψ parameters, 16Ψ per rank. ZeRO partitions that state over the N ranks
of the data-parallel group, in three stages (the paper's Figure 1; DeepSpeed's
`zero_optimization.stage`):

    stage 1  optimizer state sharded                          2Ψ + 2Ψ + 12Ψ/N per rank
    stage 2  + gradients sharded (reduce-scatter)             2Ψ + (2Ψ + 12Ψ)/N
    stage 3  + parameters sharded (gathered per module)       (2Ψ + 2Ψ + 12Ψ)/N

One optimizer step of stages 1 and 2, from rank r's point of view (DeepSpeed semantics):

    stage 1  backward as in DP (full p.grad, accumulated over micro-batches); the last
             micro-batch reduce-scatters each bucket -> my averaged gradient shard.
             AdamW on my shard, then all-gather the updated parameters.
    stage 2  every micro-batch reduce-scatters each bucket as soon as its gradients are
             complete, adds my piece into a persistent gradient shard and frees the full
             gradients (they only live until their reduce-scatter). Then as stage 1.

Communication per rank and step, in elements (no accumulation): stages 1 and 2 send
2(N-1)/N Ψ (reduce-scatter + all-gather), as much as DP's all-reduce. With A
micro-batches per step stage 1 still reduces once, stage 2 reduce-scatters A times
((A+1)(N-1)/N Ψ): keeping only a shard of the gradient means there is no full gradient
to accumulate into.
"""

from __future__ import annotations

from minipar import distributed as dist
from minipar.parallel.data.buckets import build_buckets
from minipar.parallel.zero.partition import ShardedBucket
from minipar.parallel.zero.sharded import ZeroEngine


class ZeroOptimizer(ZeroEngine):
    """ZeRO stage 1 (optimizer state sharded) or 2 (+ gradients), with AdamW: DeepSpeed's
    `DeepSpeedZeroOptimizer`, whose `partition_gradients` is our stage 2.

    named_params: this rank's (name, Parameter) pairs; group: the DP ProcessGroup;
    stage: 1 or 2; bucket_bytes: bucket capacity (0 = one flat bucket); adamw: lr, betas,
    eps, weight_decay as for `minipar.nn.AdamW`; norm_groups, counts_in_norm: as for
    `DataParallel` (the TP / PP groups the gradient norm is also summed over, and which
    of my elements count in it); overlap_comm: DeepSpeed's (see ZeroEngine).

    Every rank keeps the full flat parameters (the model's p.data are views of them) and
    owns one shard of each bucket: its optimizer state, and under stage 2 its gradient.
    """

    def __init__(self, named_params, group, *, stage: int, bucket_bytes: float = 0,
                 adamw: dict, norm_groups=(), counts_in_norm=None, overlap_comm: bool = True):
        check_stage(stage, type(self).__name__, (1, 2))
        named_params = list(named_params)
        self.stage = stage
        self.partition_gradients = stage == 2
        super().__init__(named_params, group,
                         build_buckets(named_params, bucket_bytes, group.size),
                         adamw=adamw, norm_groups=norm_groups, counts_in_norm=counts_in_norm,
                         overlap_comm=overlap_comm)

    def _partition_parameters(self, sb: ShardedBucket) -> None:
        """The full flat parameters stay on every rank; p.data become views of them."""
        bucket = sb.bucket
        sb.flat_params = bucket.flatten([p.data for p in bucket.params], self.param_dtype)
        for i, p in enumerate(bucket.params):
            p.data = bucket.view(sb.flat_params, i)
        sb.param_shard = sb.flat_params[sb.start:sb.stop]

    def synchronize_gradients(self) -> None:
        """Stage 1: reduce-scatter the buckets no hook has reduced yet (after a pipeline
        flush: the deferred ones, or all when the hooks were off) and wait. Stage 2
        reduces inside every backward, so it cannot wait until a pipeline has run all
        its micro-batches (see minipar/train/build.py)."""
        if self.partition_gradients:
            super().synchronize_gradients()
        for sb in self.shards:  # the buckets no hook reduced during the last backward
            if sb.bucket.index not in self._launched:
                self.reduce_bucket(sb)
        self.finish_gradient_synchronization()

    def step(self, lr: float) -> None:
        """AdamW on my shard, then all-gather every bucket's new parameters into the
        flat replica (every rank runs the whole forward)."""
        super().step(lr)
        for sb in self.shards:
            with dist.transient(dist.all_gather(sb.param_shard, group=self.group)) as full:
                sb.flat_params[...] = full

    def zero_grad(self) -> None:
        """Set-to-none: the gradient shard goes (ZeroEngine) and, under stage 1, the
        full local gradients too (stage 2 freed them after each reduce-scatter)."""
        super().zero_grad()
        for sb in self.shards:
            for p in sb.bucket.params:
                p.release_grad()


def check_stage(stage: int, engine: str, accepted: tuple[int, ...]) -> None:
    """A clear error for a stage that is not ZeRO's, or not this engine's."""
    if stage not in (1, 2, 3):
        raise ValueError(f"{engine}: stage must be 1, 2 or 3, got {stage}")
    if stage not in accepted:
        raise ValueError(f"{engine} runs ZeRO stage {' or '.join(map(str, accepted))}, "
                         f"not {stage}: ZeRO-3 is Zero3Optimizer (minipar/parallel/zero/stage3.py)")
