"""ZeRO stage 3: parameters sharded too (Rajbhandari et al. 2020, section 5.3, "P_os+g+p";
DeepSpeed's `runtime/zero/stage3.py`, PyTorch FSDP's FULL_SHARD).

Between uses, a rank keeps only its shard of every parameter: (2Ψ + 2Ψ + 12Ψ)/N bytes of
model state with mixed precision. The model is cut into *units* (the embeddings, each
block, the head: `gpt_units`); each unit's parameters are one flat bucket padded to a
multiple of N, and rank r owns its r-th piece (`ZeroEngine` in sharded.py: flat shards,
the reduce-scatter of gradients as in stage 2, AdamW on my shard).

One micro-batch, from rank r's point of view (forward hooks on every unit's module, as
FSDP2's `fully_shard` and DeepSpeed's `parameter_offload.py` register them):

    for unit in forward order:                       # GPT.embed, each block, GPT.head
        gather(unit)        pre-forward hook: all-gather the flat parameters; p.data
                            become views of them
        y = unit(x)
        free(unit)          forward hook: p.data become empty placeholders again
    backward, for unit in reverse order:
        gather(unit)        GatherBeforeBackward on the unit's output: just before
                            backward reaches the unit
        ... its backward ...
        its gradients complete -> reduce_bucket: flatten, free(unit), reduce-scatter,
                                  accumulate my shard (as stage 2)
    step: AdamW on my shard; no all-gather (the next forward gathers)

Communication per rank and step, in elements: 3(N-1)/N Ψ (two all-gathers and a
reduce-scatter), 1.5x DP (the paper's section 7.2.1); with A micro-batches per step
3A(N-1)/N Ψ: sharded parameters must be fetched for every forward and backward.

Prefetch (`prefetch=True`, `--zero3-prefetch`, the default): as a module's forward
starts, the next module's all-gather is launched asynchronously, and as a module's
backward starts, the previous module's; so the transfer runs while the current module
computes, and the gather that needs it finds it done (FSDP's `forward_prefetch=True` and
`backward_prefetch=BACKWARD_PRE`; DeepSpeed's `stage3_prefetch_bucket_size`, which
prefetches by a budget of elements rather than one module). The buffer the all-gather
writes into exists from the launch (`dist.all_gather(..., out=)`), so two units' full
parameters can be alive at once. The order is the order the hooks were registered in
(`gpt_units`' sites, the forward order), a static order where DeepSpeed records the
order of the first step.

Across nodes (docs/data-parallel-and-zero.md, "Sharding across nodes"): what a unit keeps
between its forward and its backward is a policy, FSDP2's `reshard_after_forward` (True,
the default: free; False: keep; K: keep a 1/K piece, ZeRO++'s hpZ; reshard.py); the
collectives can be swapped for ones with the same signature (`all_gather=`,
`reduce_scatter=`: ZeRO++'s quantized qwZ and qgZ, quantized.py); hybrid.py shards within
a group of K ranks and replicates across groups (HSDP, MiCS).

Where minipar differs: parameters are released right after each use and fetched again
for backward (no persistence threshold, the root module's parameters are not kept from
forward to backward). GPT's embed and head are hook points of the GPT module
(`minipar.nn.module.hook_point`) rather than modules of their own.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.function import Function
from minipar.autograd.tensor import Tensor
from minipar.parallel.data.buckets import Bucket
from minipar.parallel.zero.partition import ShardedBucket
from minipar.parallel.zero.reshard import ReshardAfterForward
from minipar.parallel.zero.sharded import ZeroEngine


class Zero3Optimizer(ZeroEngine):
    """ZeRO stage 3 over the data-parallel group, with AdamW.

    named_params: this rank's (name, Parameter) pairs; group: the DP ProcessGroup; units:
    the gather units, [(unit name, [(name, Parameter), ...]), ...] in forward order (see
    `gpt_units`); adamw, norm_groups, counts_in_norm: as for `ZeroOptimizer`; prefetch:
    gather the next unit while the current one computes; reshard: what a unit keeps
    after its forward (reshard.py; default: nothing, FSDP2's True); all_gather,
    reduce_scatter: the parameter and gradient collectives (default: minipar's, the
    ring's; ZeRO++'s quantized ones in quantized.py).
    After construction every p.data is an empty placeholder; `register_hooks` makes a
    module gather its units around its calls.
    """

    stage = 3
    partition_gradients = True

    def __init__(self, named_params, group, *, units=None, adamw: dict, norm_groups=(),
                 counts_in_norm=None, overlap_comm: bool = True, prefetch: bool = True,
                 reshard: ReshardAfterForward | None = None, all_gather=None,
                 reduce_scatter=None):
        if units is None:
            raise ValueError("Zero3Optimizer: stage 3 needs `units` (which parameters "
                             "each module gathers); see gpt_units()")
        named_params = list(named_params)
        _check_cover(named_params, units)
        self.unit_names = [name for name, _ in units]
        buckets = [Bucket(i, params, group.size) for i, (_, params) in enumerate(units)]
        super().__init__(named_params, group, buckets, adamw=adamw, norm_groups=norm_groups,
                         counts_in_norm=counts_in_norm, overlap_comm=overlap_comm,
                         reduce_scatter=reduce_scatter)
        self.reshard = ReshardAfterForward() if reshard is None else reshard
        self.all_gather = dist.all_gather if all_gather is None else all_gather
        self._in_backward = False  # keep gathered parameters for the backward
        self.prefetch_enabled = prefetch
        self._sites: list[list[ShardedBucket]] = []  # hooked calls, in forward order

    def _partition_parameters(self, sb: ShardedBucket) -> None:
        """Keep only my shard of the flat parameters."""
        bucket = sb.bucket
        flat = bucket.flatten([p.data for p in bucket.params], self.param_dtype)
        sb.param_shard = flat[sb.start:sb.stop].copy()
        # Each parameter's data is an empty array until a module gathers it: using it
        # unexpectedly fails loudly instead of computing with stale values.
        sb.placeholders = [np.empty(0, self.param_dtype) for _ in bucket.params]
        for p, placeholder in zip(bucket.params, sb.placeholders, strict=True):
            p.data = placeholder

    # -------------------------------------------------------------- gather / free
    def gather(self, shards: list[ShardedBucket]) -> None:
        """All-gather the full parameters of these units (no-op for gathered ones);
        p.data become views of the gathered flat buffer."""
        for sb in shards:
            if sb.gathered is not None:
                continue
            if sb.prefetched is not None:  # launched earlier: wait for what is left of it
                sb.prefetch_work.wait()
                sb.gathered, sb.prefetched, sb.prefetch_work = sb.prefetched, None, None
            else:
                self._all_gather(sb)
            for i, p in enumerate(sb.bucket.params):
                p.data = sb.bucket.view(sb.gathered, i)

    def _all_gather(self, sb: ShardedBucket) -> None:
        """sb.gathered = my shard all-gathered over the DP group (or, resharded to K
        ranks after forward, my piece over my K-rank group)."""
        shard, group = self.reshard.source(sb, self.group)
        sb.gathered = self.all_gather(shard, group=group)

    def prefetch(self, shards: list[ShardedBucket]) -> None:
        """Launch the all-gather of these units asynchronously (those neither gathered
        nor in flight); `gather` waits for it. The full buffer exists from now on, as
        the real all-gather writes into it from its launch."""
        for sb in shards:
            if sb.gathered is not None or sb.prefetched is not None:
                continue
            sb.prefetched = np.empty(sb.bucket.padded_numel, self.param_dtype)
            shard, group = self.reshard.source(sb, self.group)
            sb.prefetch_work = self.all_gather(shard, group=group, async_op=True,
                                               out=sb.prefetched)

    def free(self, shards: list[ShardedBucket]) -> None:
        """Drop gathered full parameters: each p.data is its empty placeholder again."""
        for sb in shards:
            if sb.prefetched is not None:  # never used: finish the transfer, drop the buffer
                sb.prefetch_work.wait()
                sb.prefetched, sb.prefetch_work = None, None
            if sb.gathered is None:
                continue
            for p, placeholder in zip(sb.bucket.params, sb.placeholders, strict=True):
                p.data = placeholder
            sb.gathered = None

    # -------------------------------------------------------------- the hooks
    def register_hooks(self, module, unit_names: list[str], method: str = "forward") -> None:
        """Gather the units `unit_names` around every call of `module.<method>` (its
        forward, or a hook point such as GPT.embed): a pre-forward hook gathers, a
        forward hook frees, and GatherBeforeBackward on the output gathers again when
        backward reaches it (FSDP2's `_pre_forward` / `_post_forward` and its pre-backward
        hook on the outputs; DeepSpeed's `_pre_forward_module_hook`,
        `_post_forward_module_hook` and `PreBackwardFunctionForModule`)."""
        shards = [self.shards[self.unit_names.index(name)] for name in unit_names]
        site = len(self._sites)  # registered in forward order: this call's place in it
        self._sites.append(shards)

        def pre_forward(module, args) -> None:
            self.gather(shards)
            if not self._in_backward:  # forward prefetch: the next module's parameters
                self._prefetch_site(site + 1)

        def post_forward(module, args, out):
            if isinstance(out, Tensor) and out.requires_grad:  # pre-backward
                out = GatherBeforeBackward.apply(out, lambda: self._pre_backward(site))
            if not self._in_backward:  # post-forward (a recomputation in backward keeps them)
                self.reshard.after_forward(self, shards)
            return out

        module.register_forward_pre_hook(pre_forward, method=method)
        module.register_forward_hook(post_forward, method=method)

    def _prefetch_site(self, site: int) -> None:
        if self.prefetch_enabled and 0 <= site < len(self._sites):
            self.prefetch(self._sites[site])

    def _pre_backward(self, site: int) -> None:
        self._in_backward = True
        self.gather(self._sites[site])
        self._prefetch_site(site - 1)  # backward prefetch: the module backward reaches next

    # -------------------------------------------------------------- gradients
    def _on_gradient_ready(self, param) -> None:
        self._in_backward = True
        super()._on_gradient_ready(param)

    def _gradients_flattened(self, sb: ShardedBucket) -> None:
        super()._gradients_flattened(sb)  # the full gradients go
        self.free([sb])  # this module's backward is over: its parameters go too
        self.reshard.after_backward(sb)

    def step(self, lr: float) -> None:
        super().step(lr)
        self.reshard.after_step(self.shards)  # no copy of the old parameters survives

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        self.free(self.shards)
        self._in_backward = False


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
    (ln_f, and lm_head when untied). Returns (units, sites): units as Zero3Optimizer
    takes them; sites [(module, method, [unit names])] for `register_hooks`: GPT.embed
    needs "embed", each block's forward its own unit, GPT.head needs "head" and, with
    tied embeddings, also "embed" (the LM head is wte). Units without parameters on this
    rank are left out.
    """
    named_params = list(named_params)
    blocks = {f"h.{i}": block for i, block in zip(model.layers, model.h, strict=True)}
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
    sites = [(module, method, [u for u in names if u in present])
             for module, method, names in sites]
    return units, [site for site in sites if site[2]]


def _check_cover(named_params, units) -> None:
    expected = [name for name, _ in named_params]
    got = [name for _, params in units for name, _ in params]
    if sorted(expected) != sorted(got):
        missing = sorted(set(expected) - set(got))
        extra = sorted({name for name in got if name not in expected or got.count(name) > 1})
        raise ValueError(f"ZeRO-3 units must hold every parameter exactly once: missing "
                         f"{missing}, unexpected or repeated {extra}")
