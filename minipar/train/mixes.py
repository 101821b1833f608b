"""Which dp x tp x pp x cp x ep x zero mixes run, for this model.

`check_layout(config)` decides, before anything runs, whether a mix is supported; it
raises a `ConfigError` that names the setting and the fix, or returns warnings (a TP
group across nodes, a pipeline that never fills) that the report carries. These are the
rules that need the model and its vocabulary (heads, layers and vocabulary that split,
a sequence that cuts into chunks) or are the trainer's own refusals; the settings'
rules that need neither are checked when the TrainConfig is built (config.py,
layout.py). `train` runs it once per run, after reading the data.

ZeRO-2/3 with pipeline parallelism is refused, as DeepSpeed refuses it
(`PipelineEngine` asserts `zero_optimization_stage() < 2`). A pipeline runs m >= pp
micro-batches per step, and ZeRO-2 must reduce-scatter each micro-batch's gradients
during its backward (it keeps only a shard, so there is no full gradient to accumulate
into): m reduce-scatters per step instead of one, (m+1)(N-1)/N Psi bytes instead of
2(N-1)/N Psi. ZeRO-3 would all-gather each stage's parameters for every micro-batch's
forward and again for its backward: 3m(N-1)/N Psi. Both are measured with gradient
accumulation, which is the same thing (docs/data-parallel-and-zero.md). ZeRO-1 keeps the
full gradient, accumulates the m micro-batches locally and reduce-scatters once, after the
pipeline has flushed and the tied embedding's two copies have summed their gradients.
"""

from __future__ import annotations

from minipar import distributed as dist
from minipar.errors import ConfigError, PipelineError, flag
from minipar.parallel.context.layout import SELECTIVE_WITH_CP, validate_context_parallel
from minipar.parallel.expert.dispatch import expert_layout_problem
from minipar.parallel.pipeline.model import check_layer_split
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, check_schedule_settings
from minipar.parallel.tensor.model import validate_tensor_parallel
from minipar.train.config import TrainConfig, gpt_config


def check_layout(config: TrainConfig) -> list[str]:
    """Raise ConfigError if this dp x tp x pp x zero mix cannot run (naming the fix);
    otherwise return warnings about a layout that runs but costs more than it should.
    config.vocab_size must be resolved (the data's vocabulary)."""
    tp, pp, v, m = config.tp, config.pp, config.virtual_stages, config.grad_accum_steps
    if pp > 1 and config.zero >= 2:
        z = config.zero
        raise ConfigError(
            "zero", f"--zero {z} with --pp {pp} is refused, as DeepSpeed refuses it: ZeRO-{z} "
            "reduce-scatters gradients" + (" and all-gathers parameters" if z == 3 else "")
            + " for every micro-batch, and a pipeline runs many micro-batches per step "
            "(at least pp to fill it), so the DP traffic would be paid per micro-batch "
            "instead of once per step. Use --zero 1 with --pp (it shards the optimizer "
            f"state, 12 of the 16 bytes per parameter in bf16-mixed), or --pp 1 with --zero {z}")
    if config.moe_num_experts:  # the mixes MoE cannot run yet (parallel/expert.py)
        problem = expert_layout_problem(config.cp, config.zero, config.ep,
                                        config.offload_optimizer, config.offload_param)
        if problem is not None:
            raise ConfigError(*problem)
    if config.sequence_parallel and tp == 1:
        raise ConfigError("sequence_parallel", "sequence parallelism splits the regions "
                          "tensor parallelism leaves replicated, so it needs --tp 2 or more; "
                          "add --tp or drop --sequence-parallel")
    # the schedule's own rules (its registry entry), then enough layers for its stages
    check_schedule_settings(config.schedule, pp, m, v, ConfigError)
    try:
        check_layer_split(None, config.n_layer, pp * v)
    except PipelineError as err:
        raise ConfigError("schedule", str(err)) from None
    if tp > 1:
        try:
            validate_tensor_parallel(gpt_config(config), tp, config.sequence_parallel)
        except ValueError as err:
            raise ConfigError("tp", str(err)) from None
    if config.cp > 1 and config.recompute.selective:
        raise ConfigError("recompute_granularity", SELECTIVE_WITH_CP)
    if config.cp > 1:
        try:
            validate_context_parallel(gpt_config(config), config.cp, config.cp_load_balance,
                                      tp, config.sequence_parallel)
        except ValueError as err:
            raise ConfigError("cp", str(err)) from None
    if config.check and config.dropout > 0 and config.world_size > 1:
        raise ConfigError("check", f"with --dropout {config.dropout} every rank (and "
                          "pipeline stage) draws its own dropout masks, which cannot equal "
                          "the single device's; check equivalence with --dropout 0")
    warnings = sharding_across_nodes(config)
    crossing = tp_groups_across_nodes(config)
    if crossing:
        warnings.append(
            f"tensor-parallel group(s) {crossing[0]}{' ...' if len(crossing) > 1 else ''} "
            f"span nodes (--tp {tp}, --gpus-per-node {config.gpus_per_node}): their "
            "per-layer all-reduces cross the inter-node network instead of NVLink; make "
            "--tp a divisor of --gpus-per-node")
    if pp > 1 and m < pp:
        spec = SCHEDULES[config.schedule]
        warnings.append(
            f"--grad-accum-steps {m} gives the {pp}-stage pipeline fewer micro-batches than "
            f"stages, so it never fills: with uniform stages and free communication "
            f"{spec.bubble_formula} = {spec.uniform_bubble(pp, m, v):.0%} of rank-time "
            f"idle; use --grad-accum-steps {pp} or more")
    return warnings


def sharding_across_nodes(config: TrainConfig) -> list[str]:
    """ZeRO-3 across nodes: the mixes not built (with --ep, offload; HSDP with ZeRO++);
    qgZ's two levels need the data-parallel group spread evenly over its nodes
    (--gpus-per-node); warnings when a group meant to stay inside a node does not
    (HSDP's shard group, the secondary partition's), or when qgZ has one node and so,
    as DeepSpeed, reduce-scatters."""
    asked = config.sharding_across_nodes()
    if not asked:
        return []
    name = asked[0]
    if config.ep > 1:
        raise ConfigError(name, f"{flag(name)} with --ep {config.ep} is not built (the expert "
                          "engines shard over the expert-data-parallel group); use --ep 1")
    if config.offload_optimizer != "none" or config.offload_param != "none":
        raise ConfigError(name, f"{flag(name)} with offloading is not built (DeepSpeed's "
                          "MiCS: \"Local sharding has no support for CPU offloading\"); drop "
                          "--offload-optimizer / --offload-param")
    zeropp = [n for n in asked if n.startswith("zero_")]
    if config.hsdp_shard_size is not None and zeropp:
        raise ConfigError(zeropp[0], f"{flag(zeropp[0])} with --hsdp-shard-size is not built: "
                          "hybrid sharding already keeps ZeRO-3's gathers inside the shard "
                          "group (DeepSpeed runs MiCS and ZeRO++ apart); use one")
    mesh = dist.DeviceMesh(config.dp, config.pp, config.tp, cp=config.cp,
                           world_size=config.world_size, gpus_per_node=config.gpus_per_node)
    by_node = mesh.data_parallel_ranks_by_node(0)
    per_node = {len(ranks) for ranks in by_node}
    warnings = []
    if config.zero_quantized_gradients:
        if len(per_node) > 1:
            raise ConfigError("zero_quantized_gradients", f"qgZ's all-to-all inside each node "
                              f"then across nodes needs the same number of data-parallel "
                              f"ranks on every node; --gpus-per-node {config.gpus_per_node} "
                              f"puts {[len(r) for r in by_node]} on the nodes: choose "
                              "--gpus-per-node to divide the world evenly")
        if len(by_node) == 1:
            warnings.append("--zero-quantized-gradients with the data-parallel group on one "
                            "node: qgZ reduce-scatters as ZeRO-3 does (DeepSpeed's stage3.py "
                            "uses its all-to-all only when num_nodes > 1); give it 2 nodes "
                            "or more (--gpus-per-node)")
    node_size = min(per_node)
    hpz, reshard = config.zero_hpz_partition_size, config.reshard_after_forward
    for name, size, role in (
            ("hsdp_shard_size", config.hsdp_shard_size, "shard group"),
            ("zero_hpz_partition_size", hpz if hpz > 1 else None, "secondary partition"),
            ("reshard_after_forward", None if isinstance(reshard, bool) else reshard,
             "secondary partition")):
        if size is not None and node_size % size:
            warnings.append(f"{flag(name)} {size}: some {role}s span nodes (a node holds "
                            f"{node_size} data-parallel ranks), so their all-gathers cross "
                            f"the inter-node network; choose a divisor of {node_size}")
    return warnings


def tp_groups_across_nodes(config: TrainConfig) -> list[list[int]]:
    """The TP groups whose ranks are on more than one node."""
    mesh = dist.DeviceMesh(config.dp, config.pp, config.tp, cp=config.cp,
                           world_size=config.world_size, gpus_per_node=config.gpus_per_node)
    groups = [list(g.ranks) for g in mesh.all_groups("tp")]
    return [g for g in groups if len({r // config.gpus_per_node for r in g}) > 1]
