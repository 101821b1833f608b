"""ZeRO: data parallelism without redundant copies (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC20).

Data parallelism keeps the whole model state on every rank: with mixed precision 2Ψ bytes
of bf16 parameters, 2Ψ of bf16 gradients and 12Ψ of optimizer state (fp32 master weights,
Adam m and v) for Ψ parameters, 16Ψ per rank. ZeRO partitions that state over the N ranks
of the data-parallel group, in three stages (the paper's Figure 1; DeepSpeed's
`zero_optimization.stage`):

    stage 1  optimizer state sharded                          2Ψ + 2Ψ + 12Ψ/N per rank
    stage 2  + gradients sharded (reduce-scatter)             2Ψ + (2Ψ + 12Ψ)/N
    stage 3  + parameters sharded (gathered per module)       (2Ψ + 2Ψ + 12Ψ)/N

Layout. A rank's parameters are laid end to end in flat buckets (`data.Bucket`) padded to
a multiple of N, and rank r owns the r-th equal piece of every bucket: DeepSpeed's flat
partitions, PyTorch FSDP's FlatParameter. AdamW is elementwise, so updating only my piece
with `adamw_update` gives exactly the numbers of the replicated optimizer. Weight decay
applies to matrices only; a shard mixes matrices and vectors, so the update runs over
runs ("segments") of elements that share one decay value.

One optimizer step, from rank r's point of view (DeepSpeed semantics):

    stage 1  backward as in DP (full p.grad, accumulated over micro-batches); the last
             micro-batch reduce-scatters each bucket -> my averaged gradient shard.
             AdamW on my shard, then all-gather the updated parameters.
    stage 2  every micro-batch reduce-scatters each bucket as soon as its gradients are
             complete, adds my piece into a persistent gradient shard and frees the full
             gradients (they are transient "buffers"). Then as stage 1.
    stage 3  parameters exist only as my shard. Before a module's forward its parameters
             are all-gathered and freed right after; again before its backward; then its
             gradients are reduce-scattered as in stage 2. AdamW updates my shard; no
             all-gather after the step.

Communication per rank and step, in elements (no accumulation): stages 1 and 2 send
2(N-1)/N Ψ (reduce-scatter + all-gather), as much as DP's all-reduce; stage 3 sends
3(N-1)/N Ψ (two all-gathers and a reduce-scatter), 1.5x (the paper's section 7.2.1).
With A micro-batches per step: stage 1 still reduces once, stage 2 reduce-scatters A
times ((A+1)(N-1)/N Ψ), stage 3 gathers twice and reduce-scatters once per micro-batch
(3A(N-1)/N Ψ): keeping only a shard of the gradient means there is no full gradient to
accumulate into, and sharded parameters must be fetched for every forward and backward.

Gradient clipping needs the norm of the whole gradient: each rank sums the squares of its
shard, an all-reduce adds the N partial sums, and the square root is the same norm as on
a single device.
"""

from __future__ import annotations

import math

import numpy as np

from minipar import distributed as dist
from minipar.autograd.precision import bfloat16, float32
from minipar.autograd.tensor import Function, Tensor
from minipar.nn.optim import ADAMW_FLOPS_PER_ELEMENT, adamw_update, grad_norm_squared, scale_grads_
from minipar.parallel.data import (
    MAX_IN_FLIGHT,
    Bucket,
    DataParallel,
    Piece,
    build_buckets,
    sum_over_groups,
)

_CHECK_MESSAGE = ("every parameter must take part in the loss (DeepSpeed and FSDP need "
                  "the same)")


class ShardedBucket:
    """This rank's part of one flat bucket: its parameter shard, optimizer state and
    gradient shard, all (shard_numel,) arrays.

    param_shard  stage 1/2: a view of `flat_params`, the full flat parameters every
                 rank keeps (the model's p.data are views of it);
                 stage 3: the only persistent copy of my parameters
    gathered     stage 3: the all-gathered flat parameters while a module needs them
    master       fp32 master weights (mixed precision only); exp_avg, exp_avg_sq: Adam
    grad_shard   my piece of the averaged gradient (stage 2/3: persistent, accumulated
                 over micro-batches; stage 1: the result of the step's reduce-scatter)
    segments     (start, stop, weight_decay) runs of the shard; padding is in none
    norm_segments  (start, stop) runs of the shard that count in the global gradient
                 norm (all of it, unless TP replicas or a tied copy must count once)
    """

    def __init__(self, bucket: Bucket, shard: int, stage: int, weight_decay: float,
                 counts_in_norm=None):
        self.bucket, self.shard, self.stage = bucket, shard, stage
        self.start, self.stop = bucket.shard_range(shard)
        self.flat_params = None
        self.param_shard = None
        self.gathered = None
        self.placeholders = None
        self.master = self.exp_avg = self.exp_avg_sq = self.grad_shard = None
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


def _append_run(runs: list, lo: int, hi: int) -> None:
    """Append [lo, hi) to a list of (start, stop) runs, merging touching runs."""
    if runs and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi)
    else:
        runs.append((lo, hi))


class ZeroOptimizer:
    """ZeRO stage 1, 2 or 3 over the data-parallel group, with AdamW.

    named_params: this rank's (name, Parameter) pairs; group: the DP ProcessGroup;
    bucket_bytes: bucket capacity for stages 1/2 (0 = one flat bucket); units: stage 3's
    gather units, [(unit name, [(name, Parameter), ...]), ...] in forward order (see
    `gpt_units`); adamw: lr, betas, eps, weight_decay as for `minipar.nn.AdamW`;
    norm_groups, counts_in_norm: as for `DataParallel` (the TP / PP groups the gradient
    norm is also summed over, and which of my elements count in it).

    Same interface as `DataParallel`: require_backward_grad_sync,
    finish_gradient_synchronization(), clip_grad_norm_(max_norm), step(lr), zero_grad().
    """

    def __init__(self, named_params, group, *, stage: int, bucket_bytes: float = 0,
                 units=None, adamw: dict, norm_groups=(), counts_in_norm=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer: stage must be 1, 2 or 3, got {stage}")
        named_params = list(named_params)
        self.stage, self.group = stage, group
        self.world, self.rank = group.size, dist.get_rank(group)
        self.device = dist.get_device()
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

        if stage == 3:
            if units is None:
                raise ValueError("ZeroOptimizer: stage 3 needs `units` (which parameters "
                                 "each module gathers); see gpt_units()")
            _check_cover(named_params, units)
            buckets = [Bucket(i, params, self.world) for i, (_, params) in enumerate(units)]
            self.unit_names = [name for name, _ in units]
        else:
            buckets = build_buckets(named_params, bucket_bytes, self.world)
        self.shards = [ShardedBucket(b, self.rank, stage, self.weight_decay, counts_in_norm)
                       for b in buckets]
        self._shard_of = {}
        for sb in self.shards:
            self._allocate(sb)
            for p in sb.bucket.params:
                self._shard_of[id(p)] = sb
                p.register_post_accumulate_grad_hook(self._on_gradient_ready)
                # The full gradient lives only until it is reduce-scattered: a buffer.
                if stage >= 2:
                    p.grad_category = "buffers"
        self._pending = []  # (ShardedBucket, flat gradients, CollectiveWork)
        self._in_backward = False  # stage 3: keep gathered parameters for the backward

    # -------------------------------------------------------------- construction
    def _allocate(self, sb: ShardedBucket) -> None:
        """Flatten the bucket's parameters, keep what this rank holds, allocate state."""
        memory, bucket = self.device.memory, sb.bucket
        flat = bucket.flatten([p.data for p in bucket.params], self.param_dtype)
        if self.stage == 3:
            sb.param_shard = flat[sb.start:sb.stop].copy()
            memory.hold(sb.param_shard, "params")
            # Each parameter's data is an empty array until a module gathers it: using it
            # unexpectedly fails loudly instead of computing with stale values.
            sb.placeholders = [np.empty(0, self.param_dtype) for _ in bucket.params]
            for p, placeholder in zip(bucket.params, sb.placeholders, strict=True):
                p.data = placeholder
        else:
            sb.flat_params = flat
            memory.hold(flat, "params")
            for i, p in enumerate(bucket.params):
                p.data = bucket.view(flat, i)
            sb.param_shard = flat[sb.start:sb.stop]
        numel = sb.stop - sb.start
        if self.mixed:
            sb.master = sb.param_shard.astype(float32)
        sb.exp_avg = np.zeros(numel, self.state_dtype)
        sb.exp_avg_sq = np.zeros(numel, self.state_dtype)
        for array in (sb.master, sb.exp_avg, sb.exp_avg_sq):
            if array is not None:
                memory.hold(array, "optimizer")
        if self.stage >= 2:
            sb.grad_shard = np.zeros(numel, self.param_dtype)
            memory.hold(sb.grad_shard, "grads")

    # -------------------------------------------------------------- gradients
    def _on_gradient_ready(self, param) -> None:
        """Post-accumulate-grad hook: reduce-scatter a bucket once all its gradients of
        this backward are complete (stage 1: only on the last micro-batch)."""
        self._in_backward = True
        if self.stage == 1 and not self.require_backward_grad_sync:
            return
        sb = self._shard_of[id(param)]
        bucket = sb.bucket
        bucket.ready += 1
        if bucket.ready < len(bucket.params):
            return
        bucket.ready = 0
        self._reduce_scatter(sb)

    def _reduce_scatter(self, sb: ShardedBucket) -> None:
        """Start the asynchronous reduce-scatter of one bucket's gradients."""
        bucket = sb.bucket
        if len(self._pending) == MAX_IN_FLIGHT:
            self._complete(*self._pending.pop(0))
        memory = self.device.memory
        flat = bucket.flatten_grads()
        memory.hold(flat, "buffers")
        if self.stage >= 2:
            for p in bucket.params:  # the flat copy is all we still need
                p.release_grad()
        if self.stage == 3:
            self._free([sb])  # this module's backward is over
        work = dist.reduce_scatter(flat, op="avg", group=self.group, async_op=True)
        self._pending.append((sb, flat, work))

    def _complete(self, sb: ShardedBucket, flat: np.ndarray, work) -> None:
        """Wait for one reduce-scatter; keep (stage 1) or accumulate (stage 2/3) my
        averaged gradient shard, and free the flat gradients it read."""
        memory = self.device.memory
        piece = work.wait()
        memory.hold(piece, "buffers")
        memory.release(flat)
        if self.stage == 1:
            sb.grad_shard = piece  # lives until zero_grad()
        else:
            sb.grad_shard += piece
            memory.release(piece)

    def synchronize_gradients(self) -> None:
        """Stage 1: reduce-scatter every bucket's accumulated gradients now (after a
        pipeline flush, the hooks turned off by require_backward_grad_sync = False) and
        wait. Stages 2 and 3 reduce inside every backward, so they cannot wait until a
        pipeline has run all its micro-batches (see minipar/train/build.py)."""
        if self.stage != 1:
            raise RuntimeError(f"ZeRO-{self.stage} reduce-scatters each micro-batch's "
                               "gradients during backward; only ZeRO-1 (and DP) can "
                               "synchronize after a pipeline flush")
        for sb in self.shards:
            self._reduce_scatter(sb)
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Wait for the outstanding reduce-scatters (at the end of every backward)."""
        for pending in self._pending:
            self._complete(*pending)
        self._pending = []
        for sb in self.shards:
            if sb.bucket.ready:
                raise RuntimeError(
                    f"ZeRO-{self.stage}: only {sb.bucket.ready} of the "
                    f"{len(sb.bucket.params)} parameters of bucket {sb.bucket.index} "
                    f"({', '.join(sb.bucket.names)}) got a gradient in this backward; "
                    + _CHECK_MESSAGE)
        if self.stage == 3:
            self._free(self.shards)
            self._in_backward = False

    # -------------------------------------------------------------- optimizer
    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global gradient norm: my shard's sum of squares (its counted runs;
        padding is zero and adds nothing), all-reduced over the DP group and then the
        norm groups; scale my shard if it exceeds max_norm."""
        grads = [sb.grad_shard for sb in self.shards]
        if any(g is None for g in grads):
            raise RuntimeError("ZeRO-1: no reduced gradient: run backward with "
                               "require_backward_grad_sync=True on the last micro-batch")
        counted = [sb.grad_shard[lo:hi] for sb in self.shards for lo, hi in sb.norm_segments]
        partial = np.array([grad_norm_squared(counted)])
        total = float(dist.all_reduce(partial, op="sum", group=self.group)[0])
        norm = math.sqrt(sum_over_groups(total, self.norm_groups))
        if max_norm > 0:
            scale_grads_(grads, max_norm / (norm + 1e-6))
        return norm

    def step(self, lr: float) -> None:
        """AdamW on my shard; stages 1 and 2 then all-gather the new parameters."""
        self.lr = lr
        self.step_count += 1
        beta1, beta2 = self.betas
        elements = 0
        for sb in self.shards:
            weight = sb.master if self.mixed else sb.param_shard
            for lo, hi, decay in sb.segments:
                adamw_update(weight[lo:hi], sb.grad_shard[lo:hi], sb.exp_avg[lo:hi],
                             sb.exp_avg_sq[lo:hi], self.step_count, lr, beta1, beta2,
                             self.eps, decay)
                elements += hi - lo
            if self.mixed:
                sb.param_shard[...] = sb.master.astype(self.param_dtype)
        if elements:
            self.device.compute(ADAMW_FLOPS_PER_ELEMENT * elements, "optimizer")
        if self.stage < 3:
            memory = self.device.memory
            for sb in self.shards:
                full = dist.all_gather(sb.param_shard, group=self.group)
                memory.hold(full, "buffers")
                sb.flat_params[...] = full
                memory.release(full)

    def zero_grad(self) -> None:
        memory = self.device.memory
        for sb in self.shards:
            if self.stage == 1:
                for p in sb.bucket.params:
                    p.release_grad()
                if sb.grad_shard is not None:
                    memory.release(sb.grad_shard)
                    sb.grad_shard = None
            else:
                sb.grad_shard[...] = 0

    # -------------------------------------------------------------- stage 3: gather / free
    def _gather(self, shards: list[ShardedBucket]) -> None:
        """All-gather the full parameters of these units (no-op for gathered ones)."""
        for sb in shards:
            if sb.gathered is not None:
                continue
            full = dist.all_gather(sb.param_shard, group=self.group)
            self.device.memory.hold(full, "buffers")
            sb.gathered = full
            for i, p in enumerate(sb.bucket.params):
                p.data = sb.bucket.view(full, i)

    def _free(self, shards: list[ShardedBucket]) -> None:
        """Drop gathered full parameters: each p.data is its empty placeholder again."""
        for sb in shards:
            if sb.gathered is None:
                continue
            for p, placeholder in zip(sb.bucket.params, sb.placeholders, strict=True):
                p.data = placeholder
            self.device.memory.release(sb.gathered)
            sb.gathered = None

    def hook_module(self, owner, attribute: str, unit_names: list[str]) -> None:
        """Make `owner.<attribute>(...)` (a module's forward, or GPT.embed / GPT.head)
        gather the parameters of `unit_names` first and free them after, and gather them
        again when backward reaches its output (FSDP's pre-forward / post-forward /
        pre-backward hooks)."""
        shards = [self.shards[self.unit_names.index(name)] for name in unit_names]
        forward = getattr(owner, attribute)

        def gathered_forward(*args, **kwargs):
            self._gather(shards)
            out = forward(*args, **kwargs)
            if isinstance(out, Tensor) and out.requires_grad:
                out = GatherBeforeBackward.apply(out, lambda: self._gather_for_backward(shards))
            if not self._in_backward:  # (a recomputation inside backward keeps them)
                self._free(shards)
            return out

        setattr(owner, attribute, gathered_forward)

    def _gather_for_backward(self, shards: list[ShardedBucket]) -> None:
        self._in_backward = True
        self._gather(shards)

    # -------------------------------------------------------------- state
    def parameter_pieces(self) -> list[Piece]:
        """The parameter values this rank holds: stages 1/2 the full replica (every rank
        uses it in forward), stage 3 its shard."""
        if self.stage == 3:
            return [piece for sb in self.shards
                    for piece in sb.bucket.pieces("param", sb.param_shard, self.rank)]
        return [Piece("param", name, p.shape, 0, p.size, p.data.reshape(-1),
                      p.placement, p.placement_group)
                for sb in self.shards
                for name, p in zip(sb.bucket.names, sb.bucket.params, strict=True)]

    def state_pieces(self) -> list[Piece]:
        """What this rank alone holds, for a sharded checkpoint: its shard of the
        parameters, of the master weights and of Adam's moments."""
        pieces = []
        for sb in self.shards:
            for kind, array in (("param", sb.param_shard), ("master", sb.master),
                                ("exp_avg", sb.exp_avg), ("exp_avg_sq", sb.exp_avg_sq)):
                if array is not None:
                    pieces += sb.bucket.pieces(kind, array, self.rank)
        return pieces

    def load_optimizer_state(self, step: int, state: dict[str, dict[str, np.ndarray]]) -> None:
        """Restore my shard of the optimizer state from full local tensors:
        state[kind][name], kind in exp_avg, exp_avg_sq and (mixed precision) master."""
        self.step_count = int(step)
        for sb in self.shards:
            names = sb.bucket.names
            for kind, array in (("master", sb.master), ("exp_avg", sb.exp_avg),
                                ("exp_avg_sq", sb.exp_avg_sq)):
                if array is not None:
                    full = sb.bucket.flatten([state[kind][n] for n in names], array.dtype)
                    array[...] = full[sb.start:sb.stop]

    def describe(self) -> dict:
        numel = sum(sb.bucket.numel for sb in self.shards)
        padded = sum(sb.bucket.padded_numel for sb in self.shards)
        return {"zero_stage": self.stage, "buckets": len(self.shards), "numel": numel,
                "padded_numel": padded, "padding_elements": padded - numel,
                "shard_numel": padded // self.world}


class GatherBeforeBackward(Function):
    """Identity in forward; in backward, first calls `gather` (ZeRO-3's pre-backward
    hook: the module that made this output is about to run its backward and needs its
    full parameters again)."""

    @staticmethod
    def forward(ctx, x, gather):
        ctx.gather = gather
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.gather()
        return grad, None


# ------------------------------------------------------------------ the GPT's units
def gpt_units(model, named_params) -> tuple[list, list]:
    """ZeRO-3 gather units of a `minipar.nn.GPT` and the calls that need them.

    Units (in forward order): "embed" (wte, wpe), one per block "h.<i>", and "head"
    (ln_f, and lm_head when untied). Returns (units, sites): units as ZeroOptimizer
    takes them; sites [(owner, attribute, [unit names])]: GPT.embed needs "embed", each
    block's forward its own unit, GPT.head needs "head" and, with tied embeddings, also
    "embed" (the LM head is wte). Units without parameters on this rank are left out.
    """
    named_params = list(named_params)
    blocks = {f"h.{i}": block for i, block in enumerate(model.h)}
    groups = {"embed": [], **{name: [] for name in blocks}, "head": []}
    for name, p in named_params:
        prefix = ".".join(name.split(".")[:2])
        if prefix in blocks:
            groups[prefix].append((name, p))
        elif name.startswith(("wte.", "wpe.")):
            groups["embed"].append((name, p))
        else:
            groups["head"].append((name, p))
    units = [(name, params) for name, params in groups.items() if params]
    present = {name for name, _ in units}
    sites = [(model, "embed", ["embed"])]
    sites += [(block, "forward", [name]) for name, block in blocks.items()]
    head = ["head"] + (["embed"] if model.config.tie_embeddings else [])
    sites.append((model, "head", head))
    sites = [(owner, attribute, [u for u in names if u in present])
             for owner, attribute, names in sites]
    return units, [site for site in sites if site[2]]


def data_parallel_engine(model, named_params, group, *, zero_stage: int,
                         bucket_bytes: float, adamw: dict, norm_groups=(),
                         counts_in_norm=None):
    """The engine of one DP rank: `DataParallel` for stage 0, `ZeroOptimizer` for stages
    1-3 (stage 3 also hooks the model's embed, blocks and head to gather parameters).
    norm_groups, counts_in_norm: see `DataParallel` (for TP / PP ranks)."""
    named_params = list(named_params)
    norm = {"norm_groups": norm_groups, "counts_in_norm": counts_in_norm}
    if zero_stage == 0:
        return DataParallel(named_params, group, bucket_bytes=bucket_bytes, adamw=adamw,
                            **norm)
    if zero_stage < 3:
        return ZeroOptimizer(named_params, group, stage=zero_stage, bucket_bytes=bucket_bytes,
                             adamw=adamw, **norm)
    units, sites = gpt_units(model, named_params)
    engine = ZeroOptimizer(named_params, group, stage=3, units=units, adamw=adamw, **norm)
    for owner, attribute, unit_names in sites:
        engine.hook_module(owner, attribute, unit_names)
    return engine


def _check_cover(named_params, units) -> None:
    expected = [name for name, _ in named_params]
    got = [name for _, params in units for name, _ in params]
    if sorted(expected) != sorted(got):
        missing = sorted(set(expected) - set(got))
        extra = sorted({name for name in got if name not in expected or got.count(name) > 1})
        raise ValueError(f"ZeRO-3 units must hold every parameter exactly once: missing "
                         f"{missing}, unexpected or repeated {extra}")
