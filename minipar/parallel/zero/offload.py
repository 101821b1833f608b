"""ZeRO-Offload and ZeRO-Infinity: a ZeRO rank's optimizer state and parameter shard in
host memory or on NVMe, and what crosses PCIe and the NVMe drive each step.

Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC);
Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall" (SC21); DeepSpeed's
`runtime/zero/stage_1_and_2.py` (`cpu_offload`), `stage3.py` (`offload_optimizer`,
`offload_param`), `offload_config.py` and `swap_tensor/` (the NVMe swappers). The two
switches are DeepSpeed's config keys:

    zero_optimization.offload_optimizer.device  none | cpu | nvme   (ZeRO 1, 2, 3)
    zero_optimization.offload_param.device      none | cpu | nvme   (ZeRO 3 only)

`OffloadedZeroOptimizer` (stages 1 and 2) and `OffloadedZero3Optimizer` (stage 3) are
the ZeRO engines of sharded.py with `ZeroOffload` in front: it changes where the state
is allocated, what happens to a bucket's reduced gradient, and where AdamW runs.

Where each state of my shard lives (16 bytes per parameter in bf16-mixed, the paper's
2 + 2 + 12; Psi/N elements per rank):

                          GPU                      host             NVMe
    offload_optimizer cpu bf16 params, grads*      fp32 master, m, v, fp32 grads
    offload_optimizer nvme bf16 params, grads*     fp32 grads       fp32 master, m, v
    + offload_param cpu   (gathered units only)    bf16 param shard
    + offload_param nvme  (gathered units only)                     bf16 param shard
    (* only while a step's micro-batches accumulate; see below)

One step, from rank r's point of view:

    backward  each bucket is reduce-scattered on the GPU as without offload. At the
              gradient-accumulation boundary (the last micro-batch) my reduced shard is
              cast to fp32 on the GPU and copied to the host (`.float()` then `copy_`:
              `async_inplace_copy_grad_to_fp32_buffer_from_gpu` in stage_1_and_2.py,
              `partition_grads` in stage3.py). Stages 1/2 copy with `non_blocking=True`,
              so the copy overlaps the rest of backward; stage 3's `copy_` blocks.
              Earlier micro-batches accumulate the shard on the GPU (stage 3 does so;
              stage 2 round-trips it through the host, `async_accumulate_grad_in_cpu_via_gpu`:
              minipar keeps it on the GPU, so stage 2 with accumulation holds 2Psi/N GPU
              bytes of gradient DeepSpeed would not, and moves fewer bytes).
    step      wait for the gradient copies; clip the host gradients; CPU Adam on the host
              (DeepSpeedCPUAdam, priced by `DeviceProfile.host_flops`). With NVMe, each
              shard's master, m and v are first read into host buffers and written back
              after (`PartitionedOptimizerSwapper`; `pipeline_read/write` default to
              off, so nothing overlaps). Then the new parameters go where the parameter
              shard lives: to the GPU (stages 1/2 copy fp32 and cast on the GPU,
              `fp32_partition.to(device)`; stage 3 `copy_`s into the bf16 shard, which casts
              on the CPU first, so bf16 crosses), or stay on the host (offload_param cpu),
              or are written to NVMe (offload_param nvme, `_partitioned_params_swap_out`).
    ZeRO-3    every gather of a unit first brings my shard to the GPU: host -> GPU
              (offload_param cpu), or NVMe -> host buffer -> GPU (nvme,
              `AsyncPartitionedParameterSwapper`), then the all-gather as usual; per unit,
              before its forward and again before its backward. minipar does not
              prefetch an offloaded shard (DeepSpeed prefetches the copy from host / NVMe
              too), so the copy blocks.

Where DeepSpeed's code differs from the paper, and which minipar follows: the paper
(section 4.1, Figure 2) sends fp16 gradients down and fp16 parameters up, 2 + 2 bytes per
parameter per step, converting on the CPU. DeepSpeed's code casts the gradient to fp32 on
the GPU before copying (4 bytes down) and, in stages 1/2, copies the fp32 master up
before casting (4 bytes up); stage 3 sends bf16 up. minipar follows the code (what users
run); the planner's docstring gives the paper's figure too. The paper's one-step delayed
parameter update (DPU, section 4.2), which overlaps CPU Adam with the next step, is off by
default in DeepSpeed and absent here.

Offload changes no arithmetic: the same AdamW runs on the same values in the same order,
only the ledger of another tier books them and the clock prices their copies. In fp32 and
fp64 the optimizer keeps its own copy of the parameter shard in the offload tier (DeepSpeed's
`single_partition_of_fp32_groups`), so the update happens where the state is.
"""

from __future__ import annotations

import contextlib

import numpy as np

from minipar import distributed as dist
from minipar.nn.optim import ADAMW_FLOPS_PER_ELEMENT
from minipar.parallel.booking import Held
from minipar.parallel.zero.partition import ShardedBucket
from minipar.parallel.zero.sharded import ZeroEngine
from minipar.parallel.zero.stage3 import Zero3Optimizer
from minipar.parallel.zero.stage_1_and_2 import ZeroOptimizer

DEVICES = ("none", "cpu", "nvme")
TIER_OF = {"none": "gpu", "cpu": "host", "nvme": "nvme"}


def check_offload(offload_optimizer: str, offload_param: str, stage: int) -> None:
    """A clear error for a device that is not DeepSpeed's, or a mix it does not run."""
    for name, value in (("offload_optimizer", offload_optimizer),
                        ("offload_param", offload_param)):
        if value not in DEVICES:
            raise ValueError(f"{name} must be one of {', '.join(DEVICES)}, got {value!r}")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param={offload_param} needs ZeRO stage 3, not {stage}: "
                         "below stage 3 every rank keeps the full parameters on its GPU to "
                         "run forward and backward (DeepSpeed: offload_param is 'valid only "
                         "with stage 3')")
    if offload_optimizer == "nvme" and stage < 3:
        raise ValueError(f"offload_optimizer=nvme needs ZeRO stage 3, not {stage}: "
                         "DeepSpeed's stage 1/2 optimizer (stage_1_and_2.py) has no NVMe "
                         "swapper and would keep the state in CPU memory (cpu_offload is "
                         "set for any device but none); ZeRO-Infinity's swapping is stage 3's")


class OffloadedShard(ShardedBucket):
    """A `ShardedBucket` whose optimizer state (and under stage 3 its parameter shard)
    lives in another tier, with what the trip there needs:

    optimizer_params  fp32/fp64: the optimizer's copy of my parameters in its tier
                      (DeepSpeed's fp32 partition); bf16-mixed has its master instead
    reduced           my shard of the latest reduce-scatter, on the GPU
    accumulator       my gradient shard summed on the GPU over a step's earlier
                      micro-batches, until the boundary sends it to the host
    """

    optimizer_params = Held("optimizer")
    reduced = Held("grads")
    accumulator = Held("grads")

    def __init__(self, bucket, shard: int, weight_decay: float, counts_in_norm=None, *,
                 partition_gradients: bool, optimizer_tier: str, param_tier: str):
        super().__init__(bucket, shard, weight_decay, counts_in_norm,
                         partition_gradients=partition_gradients)
        for name in ("master", "exp_avg", "exp_avg_sq", "optimizer_params"):
            self.booking[name] = ("optimizer", optimizer_tier)
        self.booking["param_shard"] = ("params", param_tier)
        if optimizer_tier != "gpu":
            self.booking["grad_shard"] = ("grads", "host")  # the host's fp32 gradient
        if not partition_gradients:  # ZeRO-1 keeps the full p.grad until the step
            self.booking["reduced"] = ("buffers", "gpu")


class ZeroOffload(ZeroEngine):
    """What offload changes in a ZeRO engine: its state in the tiers of
    `offload_optimizer` and `offload_param`, the reduced gradient sent to the host at
    the accumulation boundary, AdamW on the host CPU, and the new parameters copied to
    where the parameter shard lives. Put in front of a ZeRO engine class (below)."""

    def _place(self, offload_optimizer: str, offload_param: str, stage: int) -> None:
        check_offload(offload_optimizer, offload_param, stage)
        self.offload_optimizer, self.offload_param = offload_optimizer, offload_param
        self.optimizer_tier = TIER_OF[offload_optimizer]
        self.param_tier = TIER_OF[offload_param]

    def _sharded_bucket(self, bucket, counts_in_norm) -> OffloadedShard:
        return OffloadedShard(bucket, self.rank, self.weight_decay, counts_in_norm,
                              partition_gradients=self.partition_gradients,
                              optimizer_tier=self.optimizer_tier, param_tier=self.param_tier)

    def _allocate_optimizer_state(self, sb: OffloadedShard) -> None:
        """The 12Ψ/N in the optimizer's tier (placing them there at start-up is not
        priced, as loading the weights is not); fp32/fp64 add the optimizer's own copy
        of my parameters there, so the update happens where the state is."""
        if not self.mixed:
            sb.optimizer_params = sb.param_shard.copy()
        super()._allocate_optimizer_state(sb)

    # -------------------------------------------------------------- gradients
    def _complete(self, sb: OffloadedShard, flat: np.ndarray, work) -> None:
        """The optimizer runs on the host: sum my shard on the GPU until the step's last
        micro-batch (the accumulation boundary), then send it to the host."""
        if self.optimizer_tier == "gpu":
            super()._complete(sb, flat, work)
            return
        sb.reduced = work.wait()
        dist.release(flat)
        if sb.accumulator is not None:  # add the earlier micro-batches' sum
            sb.accumulator += sb.reduced
            sb.reduced, sb.accumulator = sb.accumulator, None
        if not (self.stage == 1 or self.require_backward_grad_sync):
            sb.accumulator, sb.reduced = sb.reduced, None  # not the boundary yet
            return
        # Cast on the GPU, then copy down (asynchronously in stages 1/2).
        with dist.transient(sb.reduced.astype(self.state_dtype)) as cast:
            if sb.grad_shard is None:
                sb.grad_shard = np.empty_like(cast)
                dist.copy_into(sb.grad_shard, cast, "to_host", async_op=self.stage < 3)
            else:  # a second boundary before the step adds into the host gradient
                host = dist.copy_to_host(cast, "grads", async_op=self.stage < 3)
                sb.grad_shard += host
                dist.release(host)
        sb.reduced = None

    def main_grads(self, params) -> list[np.ndarray]:
        if self.optimizer_tier != "gpu":
            raise RuntimeError(f"ZeRO-{self.stage} with the optimizer offloaded: the "
                               "gradient shard leaves the GPU as its reduction completes")
        return super().main_grads(params)

    # -------------------------------------------------------------- the step
    def clip_grad_norm_(self, max_norm: float) -> float:
        if self.optimizer_tier != "gpu":
            dist.wait_transfers()  # the host gradients must have arrived
        return super().clip_grad_norm_(max_norm)

    def _step_shards(self, lr: float) -> None:
        """On the host CPU when the optimizer state is offloaded (CPU Adam)."""
        if self.optimizer_tier == "gpu":
            super()._step_shards(lr)
            return
        dist.wait_transfers()
        for sb in self.shards:
            self._update_shard(sb, lr)

    def _update_shard(self, sb: OffloadedShard, lr: float) -> int:
        """AdamW where the state lives (states on NVMe are read into host buffers first
        and written back after), then the new weights into my parameter shard, wherever
        it lives. Returns the elements updated."""
        weights = sb.master if self.mixed else sb.optimizer_params
        states = [weights, sb.exp_avg, sb.exp_avg_sq]
        if self.optimizer_tier == "gpu":  # ZeRO-3 with only its parameters offloaded
            elements = self._adamw(sb, *states, lr)
            self._store_parameters(sb.param_shard, weights, "gpu")
            return elements
        with contextlib.ExitStack() as stack:
            if self.optimizer_tier == "nvme":
                host = [stack.enter_context(dist.swap_in(state, "optimizer"))
                        for state in states]
            else:
                host = states
            elements = self._adamw(sb, *host, lr)
            dist.host_compute(ADAMW_FLOPS_PER_ELEMENT * elements)
            self._store_parameters(sb.param_shard, host[0], "host")
            if self.optimizer_tier == "nvme":
                for buffer, state in zip(host, states, strict=True):
                    dist.swap_out(buffer, state)
        return elements

    def _store_parameters(self, param_shard: np.ndarray, weights: np.ndarray,
                          weights_tier: str) -> None:
        """Write updated weights (the optimizer's dtype, in `weights_tier`: gpu or host)
        into my parameter shard, in its tier, booking what crosses."""
        target = self.param_tier
        if weights_tier == target:
            param_shard[...] = weights  # same memory tier: a cast in place, no copy
        elif weights_tier == "host" and target == "gpu":
            if self.stage < 3:  # fp32_partition.to(device), then the cast on the GPU
                gpu = dist.copy_to_device(weights)
                param_shard[...] = gpu
                dist.release(gpu)
            else:  # copy_ into the bf16 shard casts on the CPU: bf16 crosses
                with dist.transient(weights.astype(self.param_dtype), tier="host") as cast:
                    dist.copy_into(param_shard, cast, "to_device")
        elif weights_tier == "gpu" and target == "host":
            dist.copy_into(param_shard, weights, "to_host")  # cast on the CPU after
        elif target == "nvme":
            if weights_tier == "gpu":  # down first (a host buffer), then to the drive
                host = dist.copy_to_host(weights)
                self._store_parameters(param_shard, host, "host")
                dist.release(host)
                return
            with dist.transient(weights.astype(self.param_dtype), tier="host") as cast:
                dist.copy_into(param_shard, cast, "nvme_write")
        else:
            raise ValueError(f"no copy from {weights_tier} to {target}")


class OffloadedZeroOptimizer(ZeroOffload, ZeroOptimizer):
    """ZeRO-Offload: ZeRO stage 1 or 2 with the optimizer state and step on the host
    (offload_optimizer cpu). Arguments as `ZeroOptimizer`'s."""

    def __init__(self, named_params, group, *, stage: int, offload_optimizer: str = "cpu",
                 offload_param: str = "none", **kwargs):
        self._place(offload_optimizer, offload_param, stage)
        super().__init__(named_params, group, stage=stage, **kwargs)


class OffloadedZero3Optimizer(ZeroOffload, Zero3Optimizer):
    """ZeRO-Infinity: ZeRO stage 3 with the optimizer state (offload_optimizer) and the
    parameter shard (offload_param) in host memory or on NVMe. Arguments as
    `Zero3Optimizer`'s."""

    def __init__(self, named_params, group, *, offload_optimizer: str = "none",
                 offload_param: str = "none", **kwargs):
        self._place(offload_optimizer, offload_param, 3)
        super().__init__(named_params, group, **kwargs)
        if self.param_tier != "gpu":
            self.prefetch_enabled = False  # the gather fetches an offloaded shard itself

    def _all_gather(self, sb: OffloadedShard) -> None:
        """An offloaded shard comes to the GPU first (from NVMe through a host buffer)."""
        if self.param_tier == "gpu":
            super()._all_gather(sb)
            return
        if self.param_tier == "host":
            local = dist.copy_to_device(sb.param_shard)
        else:
            with dist.swap_in(sb.param_shard) as host:
                local = dist.copy_to_device(host)
        sb.gathered = dist.all_gather(local, group=self.group)
        dist.release(local)
