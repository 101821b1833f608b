"""ZeRO-Offload and ZeRO-Infinity: where a ZeRO rank's optimizer state and parameters live
(GPU, host memory, NVMe) and what crosses PCIe and the NVMe drive each step.

Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC);
Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall" (SC21); DeepSpeed's
`runtime/zero/stage_1_and_2.py` (`cpu_offload`), `stage3.py` (`offload_optimizer`,
`offload_param`), `offload_config.py` and `swap_tensor/` (the NVMe swappers). The two
switches are DeepSpeed's config keys:

    zero_optimization.offload_optimizer.device  none | cpu | nvme   (ZeRO 1, 2, 3)
    zero_optimization.offload_param.device      none | cpu | nvme   (ZeRO 3 only)

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
              before its forward and again before its backward. Without prefetch (minipar
              has none yet, issue 15) the copy blocks.

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


class Offload:
    """Where one ZeRO engine keeps its optimizer state and parameter shard, and the copies
    that move them (the bookkeeping itself is minipar.distributed.tiers).

    optimizer_tier, param_tier: gpu | host | nvme. stage: the ZeRO stage (it decides
    which copies block and which precision crosses, as DeepSpeed's two code paths do).
    """

    def __init__(self, offload_optimizer: str = "none", offload_param: str = "none", *,
                 stage: int, param_dtype, state_dtype):
        check_offload(offload_optimizer, offload_param, stage)
        self.optimizer_device, self.param_device = offload_optimizer, offload_param
        self.optimizer_tier = TIER_OF[offload_optimizer]
        self.param_tier = TIER_OF[offload_param]
        self.stage = stage
        self.param_dtype, self.state_dtype = np.dtype(param_dtype), np.dtype(state_dtype)

    @property
    def optimizer_on_gpu(self) -> bool:
        return self.optimizer_tier == "gpu"

    # -------------------------------------------------------------- gradients
    def gradient_to_host(self, gpu_gradient: np.ndarray) -> np.ndarray:
        """Cast my reduced gradient shard to the optimizer's dtype on the GPU and copy it
        to host memory (asynchronously in stages 1/2). Returns the host array, held as
        "grads" in the host ledger; the caller frees the GPU one."""
        with dist.transient(gpu_gradient.astype(self.state_dtype)) as cast:
            return dist.copy_to_host(cast, "grads", async_op=self.stage < 3)

    # -------------------------------------------------------------- the step
    def step_on_host(self, states: list[np.ndarray], update, store) -> int:
        """Run `update(*states_on_host) -> elements` on the host CPU (priced as CPU Adam),
        then `store(new_weights_on_host)`: states on NVMe are read into host buffers
        first and written back after."""
        with contextlib.ExitStack() as stack:
            if self.optimizer_tier == "nvme":
                host = [stack.enter_context(dist.swap_in(state, "optimizer"))
                        for state in states]
            else:
                host = states
            elements = update(*host)
            dist.host_compute(ADAMW_FLOPS_PER_ELEMENT * elements)
            store(host[0])
            if self.optimizer_tier == "nvme":
                for buffer, state in zip(host, states, strict=True):
                    dist.swap_out(buffer, state)
        return elements

    def store_parameters(self, param_shard: np.ndarray, weights: np.ndarray,
                         weights_tier: str) -> None:
        """Write updated weights (the optimizer's dtype, in `weights_tier`: gpu or host)
        into my parameter shard, in its tier, booking what crosses."""
        target = self.param_tier
        if weights_tier == target:
            param_shard[...] = weights  # same memory tier: a cast in place, no copy
        elif weights_tier == "host" and target == "gpu":
            if self.stage < 3:  # fp32_partition.to(device), then the cast on the GPU
                gpu = dist.copy_to_device(weights, "buffers")
                param_shard[...] = gpu
                dist.release(gpu)
            else:  # copy_ into the bf16 shard casts on the CPU: bf16 crosses
                with dist.transient(weights.astype(self.param_dtype), tier="host") as cast:
                    dist.copy_into(param_shard, cast, "to_device")
        elif weights_tier == "gpu" and target == "host":
            dist.copy_into(param_shard, weights, "to_host")  # cast on the CPU after
        elif target == "nvme":
            if weights_tier == "gpu":  # down first (a host buffer), then to the drive
                host = dist.copy_to_host(weights, "buffers")
                self.store_parameters(param_shard, host, "host")
                dist.release(host)
                return
            with dist.transient(weights.astype(self.param_dtype), tier="host") as cast:
                dist.copy_into(param_shard, cast, "nvme_write")
        else:
            raise ValueError(f"no copy from {weights_tier} to {target}")

    # -------------------------------------------------------------- ZeRO-3 fetch
    def fetch_shard(self, param_shard: np.ndarray) -> np.ndarray:
        """My parameter shard on the GPU, for an all-gather: the shard itself, or a GPU
        copy ("buffers", the caller releases it) brought from host memory or NVMe."""
        if self.param_tier == "gpu":
            return param_shard
        if self.param_tier == "host":
            return dist.copy_to_device(param_shard, "buffers")
        with dist.swap_in(param_shard) as host:
            return dist.copy_to_device(host, "buffers")

    def describe(self) -> dict:
        return {"offload_optimizer": self.optimizer_device,
                "offload_param": self.param_device}
