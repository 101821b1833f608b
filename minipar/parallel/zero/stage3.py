"""ZeRO stage 3: parameters sharded too (Rajbhandari et al. 2020, section 5.3, "P_os+g+p";
DeepSpeed's `runtime/zero/stage3.py`, PyTorch FSDP's FULL_SHARD).

Between uses, a rank keeps only its shard of every parameter: (2Ψ + 2Ψ + 12Ψ)/N bytes of
model state with mixed precision. The model is cut into *units* (the embeddings, each
block, the head: `gpt_units`); each unit's parameters are one flat bucket padded to a
multiple of N, and rank r owns its r-th piece (ZeroEngine in zero_engine.py: flat
shards, AdamW on my shard, the reduce-scatter of gradients, as in stage 2).

One micro-batch, from rank r's point of view (FSDP's pre-forward / post-forward /
pre-backward hooks; DeepSpeed's `fetch_sub_module` / `release_sub_module`):

    for unit in forward order:                       # GPT.embed, each block, GPT.head
        gather(unit)        all-gather the flat parameters; p.data become views of them
        y = unit(x)
        free(unit)          p.data become empty placeholders again
    backward, for unit in reverse order:
        gather(unit)        GatherBeforeBackward: just before backward reaches the unit
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
prefetches by a budget of elements rather than one module). Its cost is booked: the
buffer the all-gather writes into is allocated and counted as "buffers" from the launch
(`dist.all_gather(..., out=)`), so two units' full parameters can be alive at once. The
order is the modules' forward order as `hook_module` was called (`gpt_units`' sites), a
static order where DeepSpeed records the order of the first step.

Where minipar differs: parameters are released right after each use and fetched again
for backward (no persistence threshold, the root module's parameters are not kept from
forward to backward). The gather/free runs around *calls* (`hook_module(owner,
"forward", ...)`, also GPT.embed and GPT.head, which are methods rather than modules),
where FSDP registers module hooks.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.function import Function
from minipar.autograd.tensor import Tensor
from minipar.parallel.data.buckets import Bucket, Holding, Piece
from minipar.parallel.zero.sharded import ShardedBucket, ZeroEngine


class Zero3Optimizer(ZeroEngine):
    """ZeRO stage 3 over the data-parallel group, with AdamW.

    named_params: this rank's (name, Parameter) pairs; group: the DP ProcessGroup; units:
    the gather units, [(unit name, [(name, Parameter), ...]), ...] in forward order (see
    `gpt_units`); adamw, norm_groups, counts_in_norm: as for `ZeroOptimizer`;
    offload_optimizer, offload_param: none | cpu | nvme (ZeRO-Infinity, offload.py: my
    optimizer state and my parameter shard in host memory or on NVMe).
    After construction every p.data is an empty placeholder; `hook_module` makes the
    model's calls gather their units.
    """

    stage = 3
    partition_gradients = True

    def __init__(self, named_params, group, *, units=None, adamw: dict, norm_groups=(),
                 counts_in_norm=None, overlap_comm: bool = True, prefetch: bool = True,
                 offload_optimizer: str = "none", offload_param: str = "none"):
        if units is None:
            raise ValueError("Zero3Optimizer: stage 3 needs `units` (which parameters "
                             "each module gathers); see gpt_units()")
        named_params = list(named_params)
        _check_cover(named_params, units)
        self.unit_names = [name for name, _ in units]
        buckets = [Bucket(i, params, group.size) for i, (_, params) in enumerate(units)]
        super().__init__(named_params, group, buckets, adamw=adamw, norm_groups=norm_groups,
                         counts_in_norm=counts_in_norm, overlap_comm=overlap_comm,
                         offload_optimizer=offload_optimizer, offload_param=offload_param)
        self._in_backward = False  # keep gathered parameters for the backward
        # Prefetch launches the next unit's all-gather early; with the shard offloaded
        # minipar fetches it when the gather runs (blocking, no prefetch: DeepSpeed also
        # prefetches the copy from host / NVMe, which minipar does not model).
        self.prefetch_enabled = prefetch and self.offload.param_tier == "gpu"
        self._sites: list[list[ShardedBucket]] = []  # hooked calls, in forward order
        self._prefetched: dict[int, tuple[np.ndarray, object]] = {}  # bucket -> (out, work)

    def _partition_parameters(self, sb: ShardedBucket) -> None:
        """Keep only my shard of the flat parameters."""
        bucket = sb.bucket
        flat = bucket.flatten([p.data for p in bucket.params], self.param_dtype)
        sb.param_shard = dist.hold(flat[sb.start:sb.stop].copy(), "params",
                                   self.offload.param_tier)
        # Each parameter's data is an empty array until a module gathers it: using it
        # unexpectedly fails loudly instead of computing with stale values.
        sb.placeholders = [np.empty(0, self.param_dtype) for _ in bucket.params]
        for p, placeholder in zip(bucket.params, sb.placeholders, strict=True):
            p.data = placeholder

    # -------------------------------------------------------------- gather / free
    def gather(self, shards: list[ShardedBucket]) -> None:
        """All-gather the full parameters of these units (no-op for gathered ones);
        p.data become views of the gathered flat buffer, a transient "buffers" array."""
        for sb in shards:
            if sb.gathered is not None:
                continue
            prefetched = self._prefetched.pop(sb.bucket.index, None)
            if prefetched is not None:  # launched earlier: wait for what is left of it
                full = prefetched[1].wait()
            else:
                # An offloaded shard comes to the GPU first (offload.fetch_shard).
                local = self.offload.fetch_shard(sb.param_shard)
                full = dist.all_gather(local, group=self.group, category="buffers")
                if local is not sb.param_shard:
                    dist.release(local)
            sb.gathered = full
            for i, p in enumerate(sb.bucket.params):
                p.data = sb.bucket.view(full, i)

    def prefetch(self, shards: list[ShardedBucket]) -> None:
        """Launch the all-gather of these units asynchronously (those neither gathered
        nor in flight); `gather` waits for it. The full buffer is allocated and booked
        now, as the real all-gather writes into it from its launch."""
        for sb in shards:
            if sb.gathered is not None or sb.bucket.index in self._prefetched:
                continue
            out = dist.hold(np.empty(sb.bucket.padded_numel, self.param_dtype), "buffers")
            work = dist.all_gather(sb.param_shard, group=self.group, async_op=True, out=out)
            self._prefetched[sb.bucket.index] = (out, work)

    def free(self, shards: list[ShardedBucket]) -> None:
        """Drop gathered full parameters: each p.data is its empty placeholder again."""
        for sb in shards:
            prefetched = self._prefetched.pop(sb.bucket.index, None)
            if prefetched is not None:  # never used: finish the transfer, drop the buffer
                prefetched[1].wait()
                dist.release(prefetched[0])
            if sb.gathered is None:
                continue
            for p, placeholder in zip(sb.bucket.params, sb.placeholders, strict=True):
                p.data = placeholder
            dist.release(sb.gathered)
            sb.gathered = None

    def hook_module(self, owner, attribute: str, unit_names: list[str]) -> None:
        """Make `owner.<attribute>(...)` (a module's forward, or GPT.embed / GPT.head)
        run inside FSDP's three hooks for the units `unit_names`: gather before the call,
        free after it, gather again when backward reaches its output."""
        shards = [self.shards[self.unit_names.index(name)] for name in unit_names]
        site = len(self._sites)  # hooked in forward order: this call's place in it
        self._sites.append(shards)
        call = getattr(owner, attribute)

        def gathered_call(*args, **kwargs):
            self.gather(shards)  # pre-forward
            if not self._in_backward:  # forward prefetch: the next module's parameters
                self._prefetch_site(site + 1)
            out = call(*args, **kwargs)
            if isinstance(out, Tensor) and out.requires_grad:  # pre-backward
                out = GatherBeforeBackward.apply(out, lambda: self._pre_backward(site))
            if not self._in_backward:  # post-forward (a recomputation in backward keeps them)
                self.free(shards)
            return out

        setattr(owner, attribute, gathered_call)

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

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        self.free(self.shards)
        self._in_backward = False

    # -------------------------------------------------------------- state
    def parameter_pieces(self) -> list[Piece]:
        """My shard of every unit (the only parameters a rank keeps between uses)."""
        return [piece for sb in self.shards
                for piece in sb.bucket.pieces("param", sb.param_shard, self.rank)]

    def _parameter_holdings(self, sb: ShardedBucket) -> list[Holding]:
        return sb.bucket.holdings("param", self.rank, self.param_dtype, sb.param_shard)


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


def _check_cover(named_params, units) -> None:
    expected = [name for name, _ in named_params]
    got = [name for _, params in units for name, _ in params]
    if sorted(expected) != sorted(got):
        missing = sorted(set(expected) - set(got))
        extra = sorted({name for name in got if name not in expected or got.count(name) > 1})
        raise ValueError(f"ZeRO-3 units must hold every parameter exactly once: missing "
                         f"{missing}, unexpected or repeated {extra}")
