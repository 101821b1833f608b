"""Data parallelism: a replica per rank, gradients averaged once per optimizer step.

Every rank of a data-parallel (DP) group holds the whole model and its own slice of the
global batch (`minipar.train.data.micro_batch`). After backward, the ranks average their
gradients with an all-reduce, so every replica takes the same optimizer step and the
replicas stay equal. This is PyTorch's DistributedDataParallel (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB), from
one rank's point of view:

    engine = DataParallel(model.named_parameters(), mesh.dp_group(), bucket_bytes=...)
    for k in range(grad_accum_steps):
        engine.require_backward_grad_sync = k == grad_accum_steps - 1   # DDP's no_sync
        model(x_k, y_k).backward(1 / grad_accum_steps)
        engine.finish_gradient_synchronization()
    engine.clip_grad_norm_(max_norm); engine.step(lr); engine.zero_grad()

Two ideas of DDP live here:
- Accumulation without synchronisation: the micro-batches of one step add their
  gradients into `p.grad` locally, and only the last one's backward reduces (DDP's
  `no_sync`). Reducing every micro-batch would move the same bytes grad_accum_steps times
  for the same result.
- Gradient buckets (Li et al. 2020, section 3.2.3; buckets.py): parameters are grouped,
  in reverse registration order (about the order backward finishes their gradients),
  into buckets of at most `bucket_bytes`. A post-accumulate-grad hook on every parameter
  counts the bucket's finished gradients; when the last one is in, the bucket's
  all-reduce starts asynchronously while backward goes on with earlier layers, so on the
  simulated clock the transfer overlaps the compute. One bucket (bucket_bytes=0) reduces
  everything after backward, with nothing to overlap.

Composed with tensor and pipeline parallelism (minipar/train/build.py), a rank's
parameters are its TP pieces of its pipeline stage, and two things change:
- The global gradient norm sums pieces that live on other ranks too: each rank adds the
  squares of the elements it `counts_in_norm` (a TP-replicated parameter on TP rank 0
  only, a pipeline's tied embedding copy on the first stage only), then all-reduces the
  sum over the `norm_groups` (the TP and PP groups), as Megatron-LM's
  `clip_grad_norm_fp32` does over its model-parallel group.
- A pipeline runs its micro-batches' backwards inside its schedule, so the hooks are
  on only during each chunk's *last* micro-batch backward (the pipeline sets
  `require_backward_grad_sync` before every backward): a bucket's reduction starts as
  soon as its gradients are final, overlapping the rest of the flush (Megatron-LM's
  `--overlap-grad-reduce`: `enable_grad_sync()` before the last micro-batch in
  `schedules.py`). The tied embedding's gradient is final only after the first and last
  stages have summed their copies, so its bucket is deferred (`defer_reduction`), and
  `synchronize_gradients()`, called after that sum, reduces what is left and waits.
  Megatron instead reduces wte over DP first and sums the copies after
  (`finalize_model_grads`); deferring keeps the unoverlapped order, so the numbers are
  bit-identical to reducing everything after the flush.
"""

from __future__ import annotations

import math

import numpy as np

from minipar import distributed as dist
from minipar.autograd.placement import require_replicated_gradients
from minipar.nn.optim import AdamW, grad_norm_squared, scale_grads_
from minipar.parallel.booking import hold_replica
from minipar.parallel.data.buckets import Bucket, build_buckets


class DataParallel:
    """DDP plus a replicated AdamW: ZeRO stage 0 from one rank's point of view (a
    `minipar.parallel.engine.GradientEngine`).

    named_params: this rank's (name, Parameter) pairs; group: the DP ProcessGroup;
    bucket_bytes: gradient bucket capacity in bytes (0 = one bucket); adamw: keyword
    arguments of `minipar.nn.AdamW` (betas, eps, weight_decay); norm_groups: the groups
    whose ranks hold the rest of the model (TP, PP), over which the squared gradient norm
    is summed; counts_in_norm(param) -> bool: does my copy of `param` count in that sum;
    overlap_comm: False waits for each bucket's all-reduce as soon as it starts (compute
    stops while it runs: the unoverlapped baseline, same bytes and numbers).
    """

    stage = 0

    def __init__(self, named_params, group, *, bucket_bytes: float = 0, adamw: dict,
                 norm_groups=(), counts_in_norm=None, overlap_comm: bool = True):
        named_params = list(named_params)
        self.overlap_comm = overlap_comm
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.world = group.size
        self.norm_groups = tuple(norm_groups)
        self.counts_in_norm = counts_in_norm if counts_in_norm is not None else _always
        hold_replica(self.params)  # every rank keeps the whole model
        self.optimizer = AdamW(named_params, **adamw)
        self.buckets = build_buckets(named_params, bucket_bytes, shards=1)
        self._bucket_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_gradient_ready)
        self._pending = []  # (bucket, flat gradients, CollectiveWork) being reduced
        self._launched: set[int] = set()  # buckets reduced in this synchronisation
        self._deferred: set[int] = set()  # buckets only synchronize_gradients reduces
        # DDP's flag: False inside `no_sync`, i.e. on every micro-batch but the last.
        self.require_backward_grad_sync = True

    # -------------------------------------------------------------- gradient sync
    def _on_gradient_ready(self, param) -> None:
        """Post-accumulate-grad hook: launch a bucket's all-reduce once it is full."""
        if not self.require_backward_grad_sync or self.world == 1:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.index in self._deferred:
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.ready = 0
            self._reduce(bucket)

    def defer_reduction(self, params) -> None:
        """Reduce the buckets holding `params` only in synchronize_gradients (a tied
        embedding's gradient is final only after its copies are summed)."""
        self._deferred |= {self._bucket_of[id(p)].index for p in params}

    def _reduce(self, bucket: Bucket) -> None:
        """Start the asynchronous all-reduce of one bucket's gradients: the one place a
        bucket is reduced (DDP's `Reducer::mark_bucket_ready`)."""
        self._launched.add(bucket.index)
        flat = bucket.flatten_grads()
        # Average, as DDP does: each rank's loss is a mean over its share of the batch.
        work = dist.all_reduce(flat, op="avg", group=self.group, async_op=True)
        if self.overlap_comm:
            self._pending.append((bucket, flat, work))
        else:
            self._complete(bucket, flat, work)

    def synchronize_gradients(self) -> None:
        """Average the buckets no hook has reduced yet (after a pipeline flush: the
        deferred ones, or all when the hooks were off) and wait for every reduction."""
        if self.world > 1:
            for bucket in self.buckets:
                if bucket.index not in self._launched:
                    self._reduce(bucket)
        self.finish_gradient_synchronization()

    def _complete(self, bucket: Bucket, flat: np.ndarray, work) -> None:
        """Wait for one bucket's all-reduce and write the averages into p.grad."""
        with dist.transient(work.wait()) as averaged:
            for i, p in enumerate(bucket.params):
                p.grad[...] = bucket.view(averaged, i)
        dist.release(flat)

    def finish_gradient_synchronization(self) -> None:
        """Wait for the outstanding all-reduces (DDP does this in a callback at the end
        of backward)."""
        for pending in self._pending:
            self._complete(*pending)
        self._pending = []
        self._launched.clear()
        _check_all_reduced(self.buckets)

    # -------------------------------------------------------------- optimizer
    def main_grads(self, params) -> list[np.ndarray]:
        """The averaged gradient the optimizer will read for each of `params`, to be
        finished in place (Megatron's `param.main_grad`): its whole p.grad."""
        return [p.grad for p in params]

    def local_gradients(self) -> list[np.ndarray]:
        """The gradient arrays my optimizer reads (clipping scales them): every p.grad."""
        return [p.grad for p in self.params]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global gradient norm (identical on every replica after the all-reduce);
        gradients are scaled to `max_norm` when it is > 0 and exceeded."""
        require_replicated_gradients(zip(self.names, self.params, strict=True))
        grads = [p.grad for p in self.params]
        counted = [p.grad for p in self.params if self.counts_in_norm(p)]
        norm = math.sqrt(sum_over_groups(grad_norm_squared(counted), self.norm_groups))
        if max_norm > 0:
            scale_grads_(grads, max_norm / (norm + 1e-6))
        return norm

    def step(self, lr: float) -> None:
        require_replicated_gradients(zip(self.names, self.params, strict=True))
        self.optimizer.lr = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    def load_optimizer_state(self, step: int, state: dict[str, dict[str, np.ndarray]]) -> None:
        """Restore AdamW from full local tensors: state[kind][name] for kind in
        exp_avg, exp_avg_sq and (mixed precision) master."""
        flat = {"step": np.asarray(step, dtype=np.int64)}
        for key in self.optimizer.state_dict():
            if key != "step":
                kind, name = key.split(".", 1)
                flat[key] = state[kind][name]
        self.optimizer.load_state_dict(flat)


def accumulate_gradients_in(params, dtype) -> None:
    """Give every parameter of `params` a gradient buffer of `dtype` (None: its own
    dtype): each backward's gradient, computed in the parameter's dtype, is summed into
    it (minipar/autograd/engine.py), and the engines reduce and step from it. A bf16
    model with fp32 buffers is Megatron-LM's `main_grad` (megatron/core/distributed/
    param_and_grad_buffer.py: the grad buffer in fp32 when
    `--accumulate-allreduce-grads-in-fp32`, its default with --bf16); bf16 buffers are
    the ZeRO paper's 2 bytes per parameter (`--grad-reduce-in-bf16`)."""
    for p in params:
        p.grad_dtype = None if dtype is None or np.dtype(dtype) == p.data.dtype \
            else np.dtype(dtype)


def _always(param) -> bool:
    return True


def sum_over_groups(value: float, groups) -> float:
    """`value` summed over each group in turn (one fp64 all-reduce per group): a rank's
    share of a squared gradient norm -> the whole model's."""
    for group in groups:
        if group.size > 1:
            value = float(dist.all_reduce(np.array([value]), op="sum", group=group)[0])
    return value


def _check_all_reduced(buckets: list[Bucket]) -> None:
    """After backward every bucket must have been complete: a parameter that got no
    gradient would leave its bucket unreduced and the replicas silently apart."""
    for bucket in buckets:
        if bucket.ready:
            raise RuntimeError(
                f"data parallelism: only {bucket.ready} of the {len(bucket.params)} "
                f"parameters of gradient bucket {bucket.index} ({', '.join(bucket.names)}) "
                "got a gradient in this backward; every parameter must take part in the loss "
                "(DDP's find_unused_parameters is not supported)")
