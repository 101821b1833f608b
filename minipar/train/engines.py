"""The gradient engine of one rank: which data-parallel strategy wraps the parameters a
rank ended up with (DeepSpeed's `zero_optimization.stage`; with --ep, Megatron's
expert-data-parallel pair; ZeRO-3 across nodes: HSDP, ZeRO++, FSDP2's reshard choice).
Every engine is a `minipar.parallel.engine.GradientEngine`.

    engine = data_parallel_engine(model, named_params, mesh.dp_group(), zero_stage=1, ...)

`build.py` calls these after it has built the rank's model.
"""

from __future__ import annotations

from minipar.parallel.data.ddp import DataParallel
from minipar.parallel.expert.dispatch import is_expert_parameter
from minipar.parallel.expert.engine import ExpertDataParallel
from minipar.parallel.zero.hybrid import HybridShardedOptimizer
from minipar.parallel.zero.offload import OffloadedZero3Optimizer, OffloadedZeroOptimizer
from minipar.parallel.zero.quantized import AllToAllQuantReduce, QuantizedAllGather
from minipar.parallel.zero.reshard import reshard_policy
from minipar.parallel.zero.stage3 import Zero3Optimizer, gpt_units
from minipar.parallel.zero.stage_1_and_2 import ZeroOptimizer
from minipar.train.config import TrainConfig


def data_parallel_engine(model, named_params, group, *, zero_stage: int,
                         bucket_bytes: float, adamw: dict, norm_groups=(),
                         counts_in_norm=None, overlap_comm: bool = True,
                         zero3_prefetch: bool = True,
                         offload_optimizer: str = "none", offload_param: str = "none",
                         across_nodes: dict | None = None):
    """The engine of one DP rank, by ZeRO stage (DeepSpeed's `zero_optimization.stage`):
    0 `DataParallel` (DDP), 1/2 `ZeroOptimizer`, 3 `Zero3Optimizer`, whose hooks on the
    model's embed, blocks and head gather their parameters (`gpt_units`; model is a
    GPT); with an offload device, their ZeRO-Offload / ZeRO-Infinity forms
    (minipar/parallel/zero/offload.py). norm_groups, counts_in_norm: see `DataParallel`
    (TP / PP); overlap_comm: reduce buckets asynchronously (DeepSpeed's name);
    zero3_prefetch: stage 3 prefetches the next module's parameters; offload_optimizer,
    offload_param: DeepSpeed's offload devices (none, cpu, nvme); across_nodes: stage 3's
    sharding across nodes (`zero3_across_nodes`)."""
    named_params = list(named_params)
    common = {"adamw": adamw, "norm_groups": norm_groups, "counts_in_norm": counts_in_norm,
              "overlap_comm": overlap_comm}
    if zero_stage == 0:
        return DataParallel(named_params, group, bucket_bytes=bucket_bytes, **common)
    offload = {"offload_optimizer": offload_optimizer, "offload_param": offload_param}
    offloaded = offload_optimizer != "none" or offload_param != "none"
    if zero_stage in (1, 2):
        if offloaded:
            return OffloadedZeroOptimizer(named_params, group, stage=zero_stage,
                                          bucket_bytes=bucket_bytes, **offload, **common)
        return ZeroOptimizer(named_params, group, stage=zero_stage, bucket_bytes=bucket_bytes,
                             **common)
    if zero_stage != 3:
        raise ValueError(f"data_parallel_engine: zero_stage must be 0, 1, 2 or 3, "
                         f"got {zero_stage}")
    units, sites = gpt_units(model, named_params)
    across_nodes = dict(across_nodes or {})
    replicate_group = across_nodes.pop("replicate_group", None)
    if offloaded:
        engine = OffloadedZero3Optimizer(named_params, group, units=units,
                                         prefetch=zero3_prefetch, **offload, **common)
    elif replicate_group is not None:  # HSDP / MiCS: `group` is my shard group
        engine = HybridShardedOptimizer(named_params, group, replicate_group, units=units,
                                        prefetch=zero3_prefetch, **across_nodes, **common)
    else:
        engine = Zero3Optimizer(named_params, group, units=units, prefetch=zero3_prefetch,
                                **across_nodes, **common)
    for module, method, unit_names in sites:
        engine.register_hooks(module, unit_names, method=method)
    return engine


def zero3_across_nodes(config: TrainConfig, mesh) -> tuple[object, dict]:
    """(the group ZeRO-3 shards over, Zero3Optimizer's arguments) for the layout's
    sharding across nodes: HSDP's shard group and its replicate group; the reshard policy
    (FSDP2's reshard_after_forward, ZeRO++ hpZ: a secondary partition kept until the
    step); the quantized collectives (qwZ, qgZ). Every group comes from the mesh, built
    with these settings (`minipar.train.build.device_mesh`)."""
    group, options = mesh.data_parallel_group(), {}
    if config.hsdp_shard_size is not None:
        group = mesh.dp_subgroup("dp_shard")
        options["replicate_group"] = mesh.dp_subgroup("dp_replicate")
    hpz = config.zero_hpz_partition_size > 1
    reshard = config.zero_hpz_partition_size if hpz else config.reshard_after_forward
    if reshard is not True:
        secondary = None if isinstance(reshard, bool) else mesh.dp_subgroup("dp_secondary")
        options["reshard"] = reshard_policy(reshard, secondary, keep_until_step=hpz)
    if config.zero_quantized_weights:
        options["all_gather"] = QuantizedAllGather()
    if config.zero_quantized_gradients:
        options["reduce_scatter"] = AllToAllQuantReduce(mesh.dp_subgroup("dp_intra_node"),
                                                        mesh.dp_subgroup("dp_inter_node"))
    return group, options


def expert_data_parallel_engine(config: TrainConfig, model, named, mesh, adamw,
                                counts_in_norm) -> ExpertDataParallel:
    """Megatron's expert-data-parallel layout: non-expert parameters over the DP group,
    expert parameters over the expert-data-parallel group (their squared norm summed over
    the ep group too, as each ep rank holds different experts)."""
    dense = [(n, p) for n, p in named if not is_expert_parameter(n)]
    experts = [(n, p) for n, p in named if is_expert_parameter(n)]
    norm_groups = (mesh.tp_group(), mesh.pp_group())
    expert_norm_groups = (*norm_groups, mesh.ep_group())

    def engine(params, group, groups):
        return data_parallel_engine(model, params, group, zero_stage=config.zero,
                                    bucket_bytes=config.bucket_size_mb * 2**20, adamw=adamw,
                                    norm_groups=groups, counts_in_norm=counts_in_norm,
                                    overlap_comm=config.overlap_grad_reduce)

    # a pipeline stage without MoE layers (--moe-layer-freq > 1) has no experts' engine
    return ExpertDataParallel(
        engine(dense, mesh.dp_group(), norm_groups),
        engine(experts, mesh.expert_data_parallel_group(), expert_norm_groups)
        if experts else None,
        expert_norm_groups)
