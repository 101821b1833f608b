"""What every ZeRO stage shares (Rajbhandari et al. 2020): flat buckets sharded over the
data-parallel group, AdamW on my shard, the reduce-scatter of a bucket's gradients, the
global gradient norm, and the public description of what a rank holds.

Layout. A rank's parameters are laid end to end in flat buckets (`data.Bucket`) padded to
a multiple of N, and rank r owns the r-th equal piece of every bucket: DeepSpeed's flat
partitions, PyTorch FSDP's FlatParameter. AdamW is elementwise, so updating only my piece
with `adamw_update` gives exactly the numbers of the replicated optimizer. Weight decay
applies to matrices only; a shard mixes matrices and vectors, so the update runs over
runs ("segments") of elements that share one decay value.

Gradient clipping needs the norm of the whole gradient: each rank sums the squares of its
shard, an all-reduce adds the N partial sums, and the square root is the same norm as on
a single device.

The engines built on `ZeroEngine`: `ZeroOptimizer` (stages 1 and 2, zero.py) and
`Zero3Optimizer` (stage 3, zero3.py). This module is long because it is the one body the
three engines share (layout, reduction, clipping, the step, the state), read together.
Where the next features go (issues 14 and 15): a
bucket is reduced in one place, `ZeroEngine.reduce_bucket` (bucketed overlap); the
optimizer state of a shard is made in `_allocate_optimizer_state` and updated in
`_update_shard`, and where it lives (host memory, NVMe: ZeRO-Offload / ZeRO-Infinity)
is `Offload` in offload.py, which the engine asks at those points (and in `_complete`:
an offloaded optimizer's gradient goes to the host at the accumulation boundary); the
gradient shard has set-to-none
semantics (PyTorch's `zero_grad(set_to_none=True)`; DeepSpeed frees its partitioned
gradients after the step): the step's first reduce-scatter returns it (`reduce_bucket`,
booked as "grads"), `_complete` accumulates into it and `zero_grad` drops it, so no stage
holds gradient storage between steps; stage 3's gather / free / prefetch is
`Zero3Optimizer.gather` / `free` / `prefetch`.
"""

from __future__ import annotations

import math

import numpy as np

from minipar import distributed as dist
from minipar.autograd.placement import require_replicated_gradients
from minipar.autograd.precision import bfloat16, float32
from minipar.nn.optim import adamw_update, grad_norm_squared, report_optimizer, scale_grads_
from minipar.parallel.data.buckets import Bucket, Holding, Piece
from minipar.parallel.data.ddp import MAX_IN_FLIGHT, sum_over_groups
from minipar.parallel.zero.offload import Offload

CHECK_MESSAGE = ("every parameter must take part in the loss (DeepSpeed and FSDP need "
                 "the same)")


class ShardedBucket:
    """This rank's part of one flat bucket: its parameter shard, optimizer state and
    gradient shard, all (shard_numel,) arrays.

    param_shard  stage 1/2: a view of `flat_params`, the full flat parameters every
                 rank keeps (the model's p.data are views of it);
                 stage 3: the only persistent copy of my parameters
    gathered     stage 3: the all-gathered flat parameters while a module needs them
    master       fp32 master weights (mixed precision only); exp_avg, exp_avg_sq: Adam
    grad_shard   my piece of the averaged gradient, None between steps (set-to-none):
                 the step's first reduce-scatter makes it, stage 2/3 accumulate the
                 later micro-batches into it, zero_grad drops it
    optimizer_params  fp32/fp64 with the optimizer offloaded: the optimizer's copy of my
                 parameters in its tier (DeepSpeed's fp32 partition), else None
    grad_accumulator  offloaded optimizer: my gradient shard summed on the GPU over a
                 step's earlier micro-batches, until the boundary copies it to the host
    segments     (start, stop, weight_decay) runs of the shard; padding is in none
    norm_segments  (start, stop) runs of the shard that count in the global gradient
                 norm (all of it, unless TP replicas or a tied copy must count once)
    """

    def __init__(self, bucket: Bucket, shard: int, weight_decay: float,
                 counts_in_norm=None):
        self.bucket, self.shard = bucket, shard
        self.start, self.stop = bucket.shard_range(shard)
        self.flat_params = None
        self.param_shard = None
        self.gathered = None
        self.placeholders = None
        self.master = self.exp_avg = self.exp_avg_sq = self.grad_shard = None
        self.optimizer_params = self.grad_accumulator = None
        self.segments = []
        self.norm_segments = []
        for i, _, _, lo, hi in bucket.overlaps(self.start, self.stop):
            if counts_in_norm is None or counts_in_norm(bucket.params[i]):
                _append_run(self.norm_segments, lo - self.start, hi - self.start)
            decay = weight_decay if len(bucket.shapes[i]) >= 2 else 0.0  # matrices only
            lo, hi = lo - self.start, hi - self.start
            if self.segments and self.segments[-1][1] == lo and self.segments[-1][2] == decay:
                self.segments[-1] = (self.segments[-1][0], hi, decay)
            else:
                self.segments.append((lo, hi, decay))

    def optimizer_states(self):
        """(kind, array) of the optimizer state this shard keeps (master only if mixed)."""
        return [(kind, array) for kind, array in (("master", self.master),
                                                  ("exp_avg", self.exp_avg),
                                                  ("exp_avg_sq", self.exp_avg_sq))
                if array is not None]


def _append_run(runs: list, lo: int, hi: int) -> None:
    """Append [lo, hi) to a list of (start, stop) runs, merging touching runs."""
    if runs and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi)
    else:
        runs.append((lo, hi))


class ZeroEngine:
    """What every ZeRO stage shares: flat buckets sharded over the DP group, AdamW on my
    shard, the reduce-scatter of a bucket's gradients, the global gradient norm and the
    description of what I hold. A subclass says where the parameters live
    (`_partition_parameters`), whether the gradient is partitioned, and what happens
    around a bucket's reduction and after the step.

    Same interface as `DataParallel`: require_backward_grad_sync,
    finish_gradient_synchronization(), synchronize_gradients(), clip_grad_norm_(max_norm),
    step(lr), zero_grad(), parameter_pieces(), state_pieces(), holdings(), describe().
    """

    stage: int
    partition_gradients: bool  # keep only my shard of the gradient (stages 2 and 3)

    def __init__(self, named_params, group, buckets: list[Bucket], *, adamw: dict,
                 norm_groups=(), counts_in_norm=None, overlap_comm: bool = True,
                 offload_optimizer: str = "none", offload_param: str = "none"):
        self.group = group
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
        self.offload = Offload(offload_optimizer, offload_param, stage=self.stage,
                               param_dtype=self.param_dtype, state_dtype=self.state_dtype)
        self.shards = [ShardedBucket(b, self.rank, self.weight_decay, counts_in_norm)
                       for b in buckets]
        self._shard_of = {}
        for sb in self.shards:
            self._partition_parameters(sb)
            self._allocate_optimizer_state(sb)
            for p in sb.bucket.params:
                self._shard_of[id(p)] = sb
                p.register_post_accumulate_grad_hook(self._on_gradient_ready)
                # The full gradient lives only until it is reduce-scattered: a buffer.
                if self.partition_gradients:
                    p.grad_category = "buffers"
        self._pending = []  # (ShardedBucket, flat gradients, CollectiveWork)
        self._launched: set[int] = set()  # buckets reduced in this synchronisation
        self._deferred: set[int] = set()  # buckets only synchronize_gradients reduces

    # -------------------------------------------------------------- construction
    def _partition_parameters(self, sb: ShardedBucket) -> None:
        """Lay out the bucket's parameters and set `sb.param_shard` (subclasses)."""
        raise NotImplementedError

    def _allocate_optimizer_state(self, sb: ShardedBucket) -> None:
        """fp32 master weights (mixed precision) and Adam's moments of my shard only:
        the 12Ψ/N of every stage, in the optimizer's tier (GPU, host or NVMe; placing
        them there at start-up is not priced, as loading the weights is not)."""
        numel, tier = sb.stop - sb.start, self.offload.optimizer_tier
        if self.mixed:
            sb.master = dist.hold(sb.param_shard.astype(float32), "optimizer", tier)
        elif tier != "gpu" or self.offload.param_tier != "gpu":
            # fp32/fp64 offloaded: the optimizer's own copy of my shard, where it runs
            sb.optimizer_params = dist.hold(sb.param_shard.copy(), "optimizer", tier)
        sb.exp_avg = dist.hold(np.zeros(numel, self.state_dtype), "optimizer", tier)
        sb.exp_avg_sq = dist.hold(np.zeros(numel, self.state_dtype), "optimizer", tier)

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
        flat = dist.hold(sb.bucket.flatten_grads(), "buffers")
        self._gradients_flattened(sb)
        # Stage 2/3: the step's first reduction of this bucket returns the gradient shard
        # itself (set-to-none: it did not exist before); later micro-batches' are buffers
        # added into it. Stage 1 keeps the full p.grad ("grads") until the step: its
        # shard of the average is a buffer read by the step.
        first = self.partition_gradients and sb.grad_shard is None
        category = "grads" if first else "buffers"
        work = dist.reduce_scatter(flat, op="avg", group=self.group, async_op=True,
                                   category=category)
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
        first) or accumulate into it (stage 2/3, later micro-batches), and free the flat
        gradients it read."""
        piece = work.wait()
        dist.release(flat)
        if not self.offload.optimizer_on_gpu:
            self._offload_gradient(sb, piece)
            return
        if sb.grad_shard is None:
            sb.grad_shard = piece  # lives until zero_grad()
        else:
            sb.grad_shard += piece
            dist.release(piece)

    def _offload_gradient(self, sb: ShardedBucket, piece: np.ndarray) -> None:
        """The optimizer runs on the host: sum my shard on the GPU until the step's last
        micro-batch (the accumulation boundary), then send it to the host (offload.py)."""
        if sb.grad_accumulator is not None:
            sb.grad_accumulator += piece
            dist.release(piece)
            piece, sb.grad_accumulator = sb.grad_accumulator, None
        if not (self.stage == 1 or self.require_backward_grad_sync):
            dist.release(piece)  # a reduce-scatter result ("buffers") that lives on
            sb.grad_accumulator = dist.hold(piece, "grads")
            return
        host = self.offload.gradient_to_host(piece)
        dist.release(piece)
        if sb.grad_shard is None:
            sb.grad_shard = host
        else:
            sb.grad_shard += host
            dist.release(host)

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
        last backward's synchronisation; the optimizer must run on the GPU."""
        if not self.offload.optimizer_on_gpu:
            raise RuntimeError(f"ZeRO-{self.stage} with the optimizer offloaded: the "
                               "gradient shard leaves the GPU as its reduction completes")
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
        if not self.offload.optimizer_on_gpu:
            dist.wait_transfers()  # the host gradients must have arrived
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
        """AdamW on my shard of every bucket: on the GPU, or on the host CPU when the
        optimizer state is offloaded (ZeRO-Offload's CPU Adam, offload.py)."""
        require_replicated_gradients(self._named_params())
        self.lr = lr
        self.step_count += 1
        if not self.offload.optimizer_on_gpu:
            dist.wait_transfers()
            for sb in self.shards:
                self._update_shard(sb, lr)
            return
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
        """AdamW on one shard (segment by segment, for weight decay) where its state
        lives; the new weights land in `sb.param_shard`, wherever it lives. Returns the
        elements updated."""
        offload = self.offload
        weights = sb.master if self.mixed else sb.optimizer_params
        if weights is None:
            weights = sb.param_shard  # fp32/fp64 on the GPU: update in place
        beta1, beta2 = self.betas

        def update(weights, exp_avg, exp_avg_sq) -> int:
            elements = 0
            for lo, hi, decay in sb.segments:
                adamw_update(weights[lo:hi], sb.grad_shard[lo:hi], exp_avg[lo:hi],
                             exp_avg_sq[lo:hi], self.step_count, lr, beta1, beta2,
                             self.eps, decay)
                elements += hi - lo
            return elements

        def store(updated, tier: str) -> None:  # the new weights into my parameter shard
            if updated is not sb.param_shard:
                offload.store_parameters(sb.param_shard, updated, tier)

        states = [weights, sb.exp_avg, sb.exp_avg_sq]
        if offload.optimizer_on_gpu:
            elements = update(*states)
            store(weights, "gpu")
            return elements
        return offload.step_on_host(states, update, lambda host: store(host, "host"))

    def zero_grad(self) -> None:
        """Set-to-none: drop my gradient shard (the next step's first reduce-scatter
        makes a new one), so no gradient storage lives between steps."""
        for sb in self.shards:
            if sb.grad_shard is not None:
                dist.release(sb.grad_shard)
                sb.grad_shard = None

    # -------------------------------------------------------------- state
    def parameter_pieces(self) -> list[Piece]:
        """The parameter values this rank holds (subclasses)."""
        raise NotImplementedError

    def state_pieces(self) -> list[Piece]:
        """What this rank alone holds, for a sharded checkpoint: its shard of the
        parameters, of the master weights and of Adam's moments."""
        pieces = []
        for sb in self.shards:
            for kind, array in (("param", sb.param_shard), *sb.optimizer_states()):
                pieces += sb.bucket.pieces(kind, array, self.rank)
        return pieces

    def holdings(self) -> list[Holding]:
        """What this rank keeps of every tensor, per parameter: the parameters
        (`_parameter_holdings`), the gradient (my shard when it is partitioned, the
        whole local p.grad otherwise) and each optimizer state (my shard)."""
        held = []
        for sb in self.shards:
            bucket = sb.bucket
            held += self._parameter_holdings(sb)
            if self.partition_gradients:
                held += bucket.holdings("grad", self.rank, self.param_dtype, sb.grad_shard)
            else:
                held += [Holding("grad", name, p.shape, 0, p.size, np.dtype(self.param_dtype),
                                 placement=p.placement, placement_group=p.placement_group,
                                 values=None if p.grad is None else p.grad.reshape(-1))
                         for name, p in zip(bucket.names, bucket.params, strict=True)]
            for kind, array in sb.optimizer_states():
                held += bucket.holdings(kind, self.rank, array.dtype, array)
        return held

    def _parameter_holdings(self, sb: ShardedBucket) -> list[Holding]:
        raise NotImplementedError

    def load_optimizer_state(self, step: int, state: dict[str, dict[str, np.ndarray]]) -> None:
        """Restore my shard of the optimizer state from full local tensors:
        state[kind][name], kind in exp_avg, exp_avg_sq and (mixed precision) master."""
        self.step_count = int(step)
        for sb in self.shards:
            names = sb.bucket.names
            for kind, array in sb.optimizer_states():
                full = sb.bucket.flatten([state[kind][n] for n in names], array.dtype)
                array[...] = full[sb.start:sb.stop]

    def describe(self) -> dict:
        numel = sum(sb.bucket.numel for sb in self.shards)
        padded = sum(sb.bucket.padded_numel for sb in self.shards)
        return {"zero_stage": self.stage, "buckets": len(self.shards), "numel": numel,
                "padded_numel": padded, "padding_elements": padded - numel,
                "shard_numel": padded // self.world, **self.offload.describe()}


def check_stage(stage: int, engine: str, accepted: tuple[int, ...]) -> None:
    """A clear error for a stage that is not ZeRO's, or not this engine's."""
    if stage not in (1, 2, 3):
        raise ValueError(f"{engine}: stage must be 1, 2 or 3, got {stage}")
    if stage not in accepted:
        raise ValueError(f"{engine} runs ZeRO stage {' or '.join(map(str, accepted))}, "
                         f"not {stage}: ZeRO-3 is Zero3Optimizer (minipar/parallel/zero/stage3.py)")
