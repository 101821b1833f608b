"""What every ZeRO stage shares (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC20): flat buckets sharded over the
data-parallel group, the reduce-scatter of a bucket's gradients, the global gradient
norm, and AdamW on my shard.

Layout. A rank's parameters are laid end to end in flat buckets (buckets.py) padded to
a multiple of N, and rank r owns the r-th equal piece of every bucket (partition.py:
DeepSpeed's flat partitions, PyTorch FSDP's FlatParameter).

Gradients. When backward has finished every gradient of a bucket, a post-accumulate-grad
hook reduce-scatters the bucket (`reduce_bucket`, asynchronously while backward goes on:
DeepSpeed's `overlap_comm`), averaged over the group: rank r receives only its piece of
the averaged gradient. The gradient shard has set-to-none semantics (PyTorch's
`zero_grad(set_to_none=True)`; DeepSpeed frees its partitioned gradients after the
step): the step's first reduce-scatter returns it, the later micro-batches' are added
into it (stages 2 and 3), and `zero_grad` drops it, so no stage holds gradient storage
between steps.

Clipping needs the norm of the whole gradient: each rank sums the squares of its shard,
an all-reduce adds the N partial sums, and the square root is the same norm as on a
single device.

The step. AdamW is elementwise, so updating only my piece with `adamw_update` gives
exactly the numbers of the replicated optimizer. Weight decay applies to matrices only;
a shard mixes matrices and vectors, so the update runs over runs ("segments") of
elements that share one decay value.

The engines built on `ZeroEngine`: `ZeroOptimizer` (stages 1 and 2, stage_1_and_2.py)
and `Zero3Optimizer` (stage 3, stage3.py); with the optimizer state or the parameters
in host memory or on NVMe, the classes of offload.py.
"""

from __future__ import annotations

import math

import numpy as np

from minipar import distributed as dist
from minipar.autograd.placement import require_replicated_gradients
from minipar.autograd.precision import bfloat16, float32
from minipar.nn.optim import adamw_update, grad_norm_squared, report_optimizer, scale_grads_
from minipar.parallel.data.buckets import Bucket
from minipar.parallel.data.ddp import sum_over_groups
from minipar.parallel.zero.partition import ShardedBucket

# Reductions in flight at once: a rank waits for the oldest before starting a third, so
# at most two flat copies of gradients exist (DeepSpeed double-buffers its reduction
# bucket when overlap_comm is on).
MAX_IN_FLIGHT = 2
CHECK_MESSAGE = ("every parameter must take part in the loss (DeepSpeed and FSDP need "
                 "the same)")


class ZeroEngine:
    """What every ZeRO stage shares: flat buckets sharded over the DP group, the
    reduce-scatter of a bucket's gradients, the global gradient norm, AdamW on my shard.
    A subclass says where the parameters live (`_partition_parameters`), whether the
    gradient is partitioned, and what happens after a bucket's reduction and the step.
    Every ZeRO engine is a `minipar.parallel.engine.GradientEngine`.
    """

    stage: int
    partition_gradients: bool  # keep only my shard of the gradient (stages 2 and 3)

    def __init__(self, named_params, group, buckets: list[Bucket], *, adamw: dict,
                 norm_groups=(), counts_in_norm=None, overlap_comm: bool = True,
                 reduce_scatter=None):
        self.group = group
        # The collective that reduces a bucket (reduce_scatter's signature): ZeRO++'s qgZ
        # passes its quantized one (zero/quantized.py).
        self.reduce_scatter = dist.reduce_scatter if reduce_scatter is None else reduce_scatter
        # DeepSpeed's `overlap_comm`: reduce buckets asynchronously while backward goes
        # on (False: wait for each reduce-scatter as soon as it starts).
        self.overlap_comm = overlap_comm
        self.world, self.rank = group.size, dist.get_rank(group)
        self.lr = adamw.get("lr", 1e-3)
        self.betas = adamw.get("betas", (0.9, 0.95))
        self.eps = adamw.get("eps", 1e-8)
        self.weight_decay = adamw.get("weight_decay", 0.1)
        self.step_count = 0
        self.require_backward_grad_sync = True
        self.norm_groups = tuple(norm_groups)
        self.param_dtype = named_params[0][1].dtype
        # Mixed precision keeps fp32 master weights; fp32/fp64 update the parameters.
        self.mixed = self.param_dtype == bfloat16
        self.state_dtype = float32 if self.mixed else self.param_dtype
        self.shards = [self._sharded_bucket(b, counts_in_norm) for b in buckets]
        self._shard_of = {}
        for sb in self.shards:
            self._partition_parameters(sb)
            self._allocate_optimizer_state(sb)
            for p in sb.bucket.params:
                self._shard_of[id(p)] = sb
                p.register_post_accumulate_grad_hook(self._on_gradient_ready)
        self._pending = []  # (ShardedBucket, flat gradients, CollectiveWork)
        self._launched: set[int] = set()  # buckets reduced in this synchronisation
        self._deferred: set[int] = set()  # buckets only synchronize_gradients reduces

    # -------------------------------------------------------------- construction
    def _sharded_bucket(self, bucket: Bucket, counts_in_norm) -> ShardedBucket:
        return ShardedBucket(bucket, self.rank, self.weight_decay, counts_in_norm,
                             partition_gradients=self.partition_gradients)

    def _partition_parameters(self, sb: ShardedBucket) -> None:
        """Lay out the bucket's parameters and set `sb.param_shard` (subclasses)."""
        raise NotImplementedError

    def _allocate_optimizer_state(self, sb: ShardedBucket) -> None:
        """fp32 master weights (mixed precision) and Adam's moments of my shard only:
        the 12Ψ/N of every stage."""
        if self.mixed:
            sb.master = sb.param_shard.astype(float32)
        sb.exp_avg = np.zeros(sb.numel, self.state_dtype)
        sb.exp_avg_sq = np.zeros(sb.numel, self.state_dtype)

    # -------------------------------------------------------------- gradients
    def _on_gradient_ready(self, param) -> None:
        """Post-accumulate-grad hook: reduce a bucket once all its gradients of this
        backward are complete."""
        if not self._reduces_in_this_backward():
            return
        sb = self._shard_of[id(param)]
        bucket = sb.bucket
        if bucket.index in self._deferred:
            return
        bucket.ready += 1
        if bucket.ready < len(bucket.params):
            return
        bucket.ready = 0
        self.reduce_bucket(sb)

    def _reduces_in_this_backward(self) -> bool:
        """A partitioned gradient must be reduced every backward (there is no full
        gradient to accumulate into); stage 1 only when DDP's no_sync is off."""
        return self.partition_gradients or self.require_backward_grad_sync

    def defer_reduction(self, params) -> None:
        """Reduce the buckets holding `params` only in synchronize_gradients (as
        `DataParallel.defer_reduction`: a tied embedding under pipeline parallelism)."""
        self._deferred |= {self._shard_of[id(p)].bucket.index for p in params}

    def reduce_bucket(self, sb: ShardedBucket) -> None:
        """Start the asynchronous reduce-scatter of one bucket's gradients, averaged over
        the DP group: the one place a bucket is reduced (DeepSpeed's
        `reduce_ipg_grads`). At most MAX_IN_FLIGHT run at once."""
        self._launched.add(sb.bucket.index)
        if len(self._pending) == MAX_IN_FLIGHT:
            self._complete(*self._pending.pop(0))
        flat = sb.bucket.flatten_grads()
        self._gradients_flattened(sb)
        work = self.reduce_scatter(flat, op="avg", group=self.group, async_op=True)
        if self.overlap_comm:
            self._pending.append((sb, flat, work))
        else:
            self._complete(sb, flat, work)

    def _gradients_flattened(self, sb: ShardedBucket) -> None:
        """After a bucket's gradients are copied into the flat buffer being reduced."""
        if self.partition_gradients:
            for p in sb.bucket.params:  # the flat copy is all we still need
                p.release_grad()

    def _complete(self, sb: ShardedBucket, flat: np.ndarray, work) -> None:
        """Wait for one reduce-scatter; keep my averaged gradient shard (the step's
        first) or add it into the one I keep (stage 2/3, later micro-batches), and free
        the flat gradients it read."""
        if sb.grad_shard is None:
            sb.grad_shard = work.wait()  # lives until zero_grad()
            dist.release(flat)
        else:
            with dist.transient(work.wait()) as piece:
                dist.release(flat)
                sb.grad_shard += piece

    def synchronize_gradients(self) -> None:
        """Reduce every bucket now (after a pipeline flush); only ZeRO-1 can."""
        raise RuntimeError(f"ZeRO-{self.stage} reduce-scatters each micro-batch's "
                           "gradients during backward; only ZeRO-1 (and DP) can "
                           "synchronize after a pipeline flush")

    def finish_gradient_synchronization(self) -> None:
        """Wait for the outstanding reduce-scatters (at the end of every backward)."""
        for pending in self._pending:
            self._complete(*pending)
        self._pending = []
        self._launched.clear()
        for sb in self.shards:
            if sb.bucket.ready:
                raise RuntimeError(
                    f"ZeRO-{self.stage}: only {sb.bucket.ready} of the "
                    f"{len(sb.bucket.params)} parameters of bucket {sb.bucket.index} "
                    f"({', '.join(sb.bucket.names)}) got a gradient in this backward; "
                    + CHECK_MESSAGE)

    def main_grads(self, params) -> list[np.ndarray]:
        """For each of `params`, the part of my averaged gradient shard that holds it
        (empty if my shard holds none of it), to be finished in place: the part of
        Megatron's `param.main_grad` that its distributed optimizer reads. After the
        last backward's synchronisation."""
        views = []
        for p in params:
            sb = self._shard_of[id(p)]
            if sb.grad_shard is None:
                raise RuntimeError(f"ZeRO-{self.stage}: no reduced gradient yet: call "
                                   "main_grads after the last backward's synchronisation")
            i = next(i for i, q in enumerate(sb.bucket.params) if q is p)
            lo = max(sb.bucket.offsets[i], sb.start)
            hi = min(sb.bucket.offsets[i] + sb.bucket.sizes[i], sb.stop)
            views.append(sb.grad_shard[lo - sb.start:max(lo, hi) - sb.start])
        return views

    # -------------------------------------------------------------- optimizer
    def _named_params(self):
        return ((name, p) for sb in self.shards
                for name, p in zip(sb.bucket.names, sb.bucket.params, strict=True))

    def local_gradients(self) -> list[np.ndarray]:
        """The gradient arrays my optimizer reads (clipping scales them): my shards."""
        return [sb.grad_shard for sb in self.shards]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global gradient norm: my shard's sum of squares (its counted runs;
        padding is zero and adds nothing), all-reduced over the DP group and then the
        norm groups; scale my shard if it exceeds max_norm."""
        require_replicated_gradients(self._named_params())
        grads = [sb.grad_shard for sb in self.shards]
        if any(g is None for g in grads):
            raise RuntimeError(f"ZeRO-{self.stage}: no reduced gradient: run backward "
                               "(with require_backward_grad_sync=True on the last "
                               "micro-batch) before clipping or stepping")
        counted = [sb.grad_shard[lo:hi] for sb in self.shards for lo, hi in sb.norm_segments]
        partial = np.array([grad_norm_squared(counted)])
        total = float(dist.all_reduce(partial, op="sum", group=self.group)[0])
        norm = math.sqrt(sum_over_groups(total, self.norm_groups))
        if max_norm > 0:
            scale_grads_(grads, max_norm / (norm + 1e-6))
        return norm

    def step(self, lr: float) -> None:
        """AdamW on my shard of every bucket."""
        require_replicated_gradients(self._named_params())
        self.lr = lr
        self.step_count += 1
        self._step_shards(lr)

    def _step_shards(self, lr: float) -> None:
        elements = sum(self._update_shard(sb, lr) for sb in self.shards)
        if elements:
            report_optimizer(dist.get_device(), elements, elements * self._bytes_per_element())

    def _bytes_per_element(self) -> int:
        """HBM bytes AdamW moves per element (as nn.optim.adamw_bytes): reads and writes
        the parameter and each state array, reads the gradient."""
        sb = self.shards[0]
        states = (sb.master if self.mixed else None, sb.exp_avg, sb.exp_avg_sq)
        state = sum(a.itemsize for a in states if a is not None)
        return 2 * (sb.param_shard.itemsize + state) + sb.grad_shard.itemsize

    def _update_shard(self, sb: ShardedBucket, lr: float) -> int:
        """AdamW on one shard: on the fp32 master weights under mixed precision, then
        their bf16 copy into my parameter shard; fp32/fp64 update the shard in place.
        Returns the elements updated."""
        weights = sb.master if self.mixed else sb.param_shard
        elements = self._adamw(sb, weights, sb.exp_avg, sb.exp_avg_sq, lr)
        if self.mixed:
            sb.param_shard[...] = weights
        return elements

    def _adamw(self, sb: ShardedBucket, weights, exp_avg, exp_avg_sq, lr: float) -> int:
        """`adamw_update` over the shard's segments (one weight-decay value each)."""
        beta1, beta2 = self.betas
        for lo, hi, decay in sb.segments:
            adamw_update(weights[lo:hi], sb.grad_shard[lo:hi], exp_avg[lo:hi],
                         exp_avg_sq[lo:hi], self.step_count, lr, beta1, beta2, self.eps,
                         decay)
        return sum(hi - lo for lo, hi, _ in sb.segments)

    def zero_grad(self) -> None:
        """Set-to-none: drop my gradient shard (the next step's first reduce-scatter
        makes a new one), so no gradient storage lives between steps."""
        for sb in self.shards:
            sb.grad_shard = None

    def load_optimizer_state(self, step: int, state: dict[str, dict[str, np.ndarray]]) -> None:
        """Restore my shard of the optimizer state from full local tensors:
        state[kind][name], kind in exp_avg, exp_avg_sq and (mixed precision) master."""
        self.step_count = int(step)
        for sb in self.shards:
            names = sb.bucket.names
            for kind, array in sb.optimizer_states():
                full = sb.bucket.flatten([state[kind][n] for n in names], array.dtype)
                array[...] = full[sb.start:sb.stop]

