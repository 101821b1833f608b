"""Predicted offload tiers (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et
al. 2021): the host and NVMe bytes of one rank, what crosses PCIe and the NVMe drive per
step, and what that costs on the clock. The semantics are minipar.parallel.zero.offload's
(DeepSpeed's code); the tests hold these formulas to the emulator's measurements.

Per rank, with s = my shard's elements (ZeRO-1/2: one flat buffer; ZeRO-3: per unit),
p, g = parameter and gradient bytes, o = the optimizer's element size (fp32 under
bf16-mixed), K = the optimizer-state bytes per element (12 in bf16-mixed: master, m, v;
fp32/fp64 add the optimizer's own copy of the parameters, p, when offloaded):

    host  optimizer  s K (offload_optimizer cpu)    grads  s o (at the step)
          params     s p (offload_param cpu)        buffers  swap and cast buffers
    NVMe  optimizer  s K (offload_optimizer nvme)   params  s p (offload_param nvme)

Bytes per step (m micro-batches; ZeRO-3 gathers each unit 2m times, the tied embedding 3m:
plan/traffic.py):

    to_host     s o                       the fp32 gradient, once, at the boundary
    to_device   s o (ZeRO-1/2) | s p (3)  the updated parameters (offload_param none)
                + s_u p per gather         ZeRO-3 offload_param: my shard of each unit
    nvme_read   3 s o (optimizer nvme)    master, m, v in; + s_u p per gather (param nvme)
    nvme_write  3 s o (optimizer nvme)    and back out; + s p (param nvme: the new shard)

The paper's own count (section 4.1) is 2 + 2 bytes per parameter (fp16 gradients down,
fp16 parameters up); DeepSpeed's code, which minipar follows, sends fp32 gradients (4)
and, in ZeRO-1/2, fp32 parameters (4): twice the PCIe bytes of the paper's design.

Time: every copy is alpha + S/B on its link (ClusterSpec.tier_copy_time). Blocking copies
add to the rank's time: ZeRO-3's fetches (every gather) and gradient copies, the NVMe
swaps, the parameter copies after the step. ZeRO-1/2 copy each bucket's piece on its own
(one latency each), the gradient asynchronously as the bucket's reduce-scatter completes:
with one bucket (bucket_size_mb 0) nothing is left to hide it, so it is exposed in full;
with several, the copies run while the later buckets reduce (DeepSpeed's overlap), which
this formula does not credit: an upper bound, by at most the gradient copies' time.
CPU Adam costs 14 FLOPs per element at `host_flops` and replaces the GPU's optimizer time.
"""

from __future__ import annotations

from itertools import groupby

from minipar.plan.layout import ParallelConfig, StagePlan
from minipar.plan.memory import CATEGORIES, flat_pieces, shard, stage_parameters
from minipar.plan.shapes import ADAMW_FLOPS_PER_PARAMETER, ModelShape

DIRECTIONS = ("to_host", "to_device", "nvme_read", "nvme_write")


def offloads(config: ParallelConfig) -> bool:
    return config.offload_optimizer != "none" or config.offload_param != "none"


def state_itemsize(config: ParallelConfig) -> int:
    """Bytes of one optimizer element (fp32 master / moments under bf16-mixed)."""
    return 4 if config.precision == "bf16-mixed" else config.bytes.param


def shards(shape: ModelShape, config: ParallelConfig, stage: StagePlan) -> list[int]:
    """Elements of my shard of each flat buffer: one per gradient bucket for ZeRO-1/2
    (each bucket is padded and sharded on its own, and its piece copied on its own),
    one per ZeRO-3 unit."""
    return [shard(piece, config.dp)
            for piece in flat_pieces(stage_parameters(shape, config, stage), config)]


def optimizer_bytes_per_element(config: ParallelConfig) -> int:
    """The optimizer state's bytes per element in its tier: m, v (+ master in mixed
    precision), plus, in fp32/fp64 with anything offloaded, the optimizer's own copy of the
    parameters (DeepSpeed's fp32 partition)."""
    extra = 0 if config.precision == "bf16-mixed" or not offloads(config) else config.bytes.param
    return config.bytes.optimizer + extra


def gathers_per_micro_batch(shape: ModelShape, stage: StagePlan, n_units: int) -> list[int]:
    """ZeRO-3 gathers of each unit per micro-batch: before its forward and its backward,
    and the tied embedding once more for the head (plan/traffic.py's count)."""
    tied_head = shape.tie_embeddings and stage.first and stage.last
    return [2 + (1 if stage.first and i == 0 and tied_head else 0) for i in range(n_units)]


# ------------------------------------------------------------------ memory
def tier_memory(shape: ModelShape, config: ParallelConfig, stage: StagePlan) -> dict:
    """Peak bytes per category (and peak_total) of the host and NVMe tiers of one rank:
    {"host": {...}, "nvme": {...}}. Categories are exact; the host's buffers and
    peak_total are an upper bound (the swap and cast buffers of the largest shard, at
    the step, with every host gradient held)."""
    p, o = config.bytes.param, state_itemsize(config)
    sizes = shards(shape, config, stage)
    s, largest = sum(sizes), max(sizes, default=0)
    k = optimizer_bytes_per_element(config)
    host, nvme = dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0)
    optimizer_tier, param_tier = config.offload_optimizer, config.offload_param
    if optimizer_tier == "cpu":
        host["optimizer"] = s * k
    elif optimizer_tier == "nvme":
        nvme["optimizer"] = s * k
        host["optimizer"] = largest * k  # one shard's states swapped in at a time
    if optimizer_tier != "none":
        host["grads"] = s * o
    if param_tier == "cpu":
        host["params"] = s * p
    elif param_tier == "nvme":
        nvme["params"] = s * p
    # Host buffers: a ZeRO-3 shard cast to bf16 before it goes up (or to NVMe), a shard
    # swapped in from NVMe for a gather, a GPU optimizer's weights on their way to NVMe.
    cast = largest * p if config.zero == 3 and optimizer_tier != "none" and param_tier != "cpu" \
        else 0
    if param_tier == "nvme":
        cast = largest * p + (largest * o if optimizer_tier == "none" else 0)
    host["buffers"] = max(cast, largest * p if param_tier == "nvme" else 0)
    swap = host["optimizer"] if optimizer_tier == "nvme" else 0
    host["peak_total"] = (host["params"] + (s * k if optimizer_tier == "cpu" else 0)
                          + host["grads"] + swap + host["buffers"])
    nvme["peak_total"] = nvme["params"] + nvme["optimizer"]
    return {"host": host, "nvme": nvme}


# ------------------------------------------------------------------ transfers
def tier_copies(shape: ModelShape, config: ParallelConfig, stage: StagePlan
                ) -> tuple[tuple[tuple[tuple, ...], int], ...]:
    """Every copy between tiers one rank makes per step, in order, as (block, alike):
    the copies (direction, nbytes, count, blocking, phase) of one unit's shard, made for
    `alike` alike units in a row (a deep model's layers: one block, not one per layer);
    phase is "gradient", "micro" (during forward/backward) or "step"."""
    if not offloads(config):
        return ()
    p, o, m = config.bytes.param, state_itemsize(config), config.micro_batches
    sizes = shards(shape, config, stage)
    gathers = gathers_per_micro_batch(shape, stage, len(sizes))
    units = [(unit, len(list(group)))  # ((size, gathers), alike)
             for unit, group in groupby(zip(sizes, gathers, strict=True))]
    optimizer_tier, param_tier = config.offload_optimizer, config.offload_param
    blocks = []
    if optimizer_tier != "none":
        for (size, _), alike in units:  # the fp32 gradient, at the boundary; async in ZeRO-1/2
            blocks.append(((("to_host", size * o, 1, config.zero == 3, "gradient"),), alike))
    if param_tier != "none":
        for (size, times), alike in units:
            block = [("to_device", size * p, times * m, True, "micro")]
            if param_tier == "nvme":
                block.insert(0, ("nvme_read", size * p, times * m, True, "micro"))
            blocks.append((tuple(block), alike))
    for (size, _), alike in units:  # the step, shard by shard
        block = []
        if optimizer_tier == "nvme":
            block += [("nvme_read", size * o, 3, True, "step"),
                      ("nvme_write", size * o, 3, True, "step")]
        if param_tier == "none" and optimizer_tier != "none":
            up = size * o if config.zero < 3 else size * p
            block.append(("to_device", up, 1, True, "step"))
        elif param_tier != "none" and optimizer_tier == "none":
            block.append(("to_host", size * o, 1, True, "step"))
        if param_tier == "nvme":
            block.append(("nvme_write", size * p, 1, True, "step"))
        if block:
            blocks.append((tuple(block), alike))
    return tuple(blocks)


def tier_transfers(shape: ModelShape, config: ParallelConfig, stage: StagePlan) -> dict:
    """Bytes per step in each direction (the report's ranks[i].transfers, per step)."""
    totals = dict.fromkeys(DIRECTIONS, 0)
    for block, alike in tier_copies(shape, config, stage):
        for direction, nbytes, count, *_ in block:
            totals[direction] += nbytes * count * alike
    return {f"{d}_bytes": b for d, b in totals.items()}


# ------------------------------------------------------------------ time
def offload_time(shape: ModelShape, config: ParallelConfig, cluster,
                 stage: StagePlan) -> dict[str, float]:
    """Seconds one step's offload adds: `micro_s` during forward/backward (ZeRO-3's
    fetches and gradient copies, all blocking), `gradient_s` the exposed ZeRO-1/2 gradient
    copy before the step, `step_s` the step's copies and CPU Adam (`host_optimizer_s`)."""
    times = {"micro_s": 0.0, "gradient_s": 0.0, "step_s": 0.0, "host_optimizer_s": 0.0}
    for block, alike in tier_copies(shape, config, stage):
        timed = []
        for direction, nbytes, count, blocking, phase in block:
            if phase == "gradient":
                key = "micro_s" if blocking else "gradient_s"
            else:
                key = "micro_s" if phase == "micro" else "step_s"
            timed.append((key, count * cluster.tier_copy_time(direction, nbytes)))
        for _ in range(alike):  # each unit's copies in turn, as the rank makes them
            for key, seconds in timed:
                times[key] += seconds
    if config.offload_optimizer != "none":
        elements = sum(shards(shape, config, stage))
        times["host_optimizer_s"] = ADAMW_FLOPS_PER_PARAMETER * elements / cluster.host_flops
        times["step_s"] += times["host_optimizer_s"]
    return times
