"""Predicted time of one optimizer step, its pipeline bubble and MFU.

Long because one rank's micro-batch is priced here whole: compute, TP, CP and ZeRO-3
collectives (across nodes too), the data-parallel tail, the bubble; each is a few lines.

One micro-batch on pipeline rank r costs t_r = its compute (stage_seconds: each kernel of
plan/kernels.py on the cluster's roofline, or FLOPs / sustained FLOP/s on a uniform
cluster), plus the tensor-parallel collectives and ZeRO-3 gathers it waits for (minipar's
collectives block; Megatron also runs TP communication on the critical path). With full
recomputation the backward also redoes the checkpointed layers' forward (Chen et al. 2016;
Korthikanti et al. 2022, section 5: +33% of a transformer's compute, ~ 1 forward on 3),
and their TP collectives; with selective recomputation only each layer's attention core
(q k^T, softmax, p v: no communication; 2.7% for GPT-3 175B in their Table 4).

A flushing pipeline of p ranks and m micro-batches (Narayanan et al. 2021, section 2.2)
takes, for GPipe and 1F1B,

    T_pipe = sum_r t_r + (m - 1) max_r t_r        (= (m + p - 1) t for uniform stages)

and for the interleaved schedule with v chunks per rank T_pipe = (m + (p - 1)/v) max_r t_r,
plus one point-to-point hop per stage boundary on the way in and on the way out. The
bubble is the idle share of all ranks' time: (p - 1)/(m + p - 1) for uniform stages,
(p - 1)/(v m + p - 1) interleaved, as minipar.distributed.timeline.bubble_fraction measures.

After the last backward come the step's collectives (DP gradient reduction and parameter
all-gather, gradient-norm all-reduces, the tied embedding's all-reduce, the loss
broadcast) and the optimizer: AdamW's 14 FLOPs per parameter of the rank's shard.
The data-parallel part hides behind compute as far as plan/overlap.py's model says:
gradient buckets reduced while backward goes on (`overlap_grad_reduce`; under pipeline
parallelism during each chunk's last micro-batch backward), ZeRO-3's next unit gathered
while the current one computes (`zero3_prefetch`); only the exposed part is on the
critical path, and the hidden part's contention with the compute it overlaps
(`overlap_contention_seconds`: SMs and HBM that NCCL's kernels take) joins the step's
tail. With both off this is the step of a run that waits for every reduction and gather,
an upper bound of the overlapped one (tests/plan/test_estimate.py checks
both against the emulator).

Context parallelism: a rank computes its s/cp tokens (the busiest rank's ring attention
chunk pairs, minipar/plan/context.py), and each layer's ring adds only the part of its
K/V (and dK/dV) hops that its block computations do not hide (`exposed_ring_seconds`).

The schedule's exact simulation with the step's tail is pipeline_step.py.

MFU (Chowdhery et al. 2022, PaLM, appendix B) = model FLOPs per step (three forward
passes' matmuls, no recomputation; shapes.model_flops_per_sequence) / (step time x GPUs
x peak FLOP/s).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from minipar.autograd.kernels import ring_attention_block_kernels
from minipar.distributed.mesh import DeviceMesh
from minipar.parallel.pipeline.schedules.registry import uniform_bubble_fraction
from minipar.plan.buckets import Module
from minipar.plan.cluster import ClusterSpec, Link, group_rails, rails
from minipar.plan.context import (
    attention_flops_correction,
    chunk_tokens,
    diagonal_share,
    exposed_ring_seconds,
    local_shape,
    pair_flops,
)
from minipar.plan.experts import moe_flops_delta, recomputed_layers, stage_moe_layers
from minipar.plan.kernels import stage_kernels
from minipar.plan.layout import (
    ParallelConfig,
    StagePlan,
    checkpointed_layers,
)
from minipar.plan.memory import sharded_numel, stage_parameters
from minipar.plan.offload import offload_time
from minipar.plan.overlap import data_parallel_time
from minipar.plan.parameter_order import (
    embedding_late,
    embedding_tensors,
    head_ready,
    head_tensors,
    layer_ready,
    layer_tensors,
)
from minipar.plan.shapes import ADAMW_FLOPS_PER_PARAMETER, ModelShape
from minipar.plan.traffic import (
    EMBEDDING_GRADIENT_GATHER,
    GRADIENT_NORM,
    INPUT_REGATHER,
    LOGITS_INPUT_REGATHER,
    RECOMPUTED,
    SEQUENCE_PARALLEL_GRADIENTS,
    Transfer,
    data_parallel_nodes,
    placed,
    stage_traffic,
)

# The data-parallel groups whose collectives overlap.py can time: ZeRO's, and HSDP's two
DP_GROUPS = ("dp", "dp_shard", "dp_replicate")


def group_links(config: ParallelConfig, cluster: ClusterSpec, stage: int | None = None
                ) -> dict[str, int]:
    """How the dp, tp, cp and pp groups cross nodes under the config's rank order
    (minipar's mesh dp x pp x cp x tp, or Megatron-LM's default with pp slowest:
    `ParallelConfig.strides`), and the expert-parallel groups inside DP: ep consecutive
    dp indices ("ep") and the dp / ep ranks holding the same experts ("edp"). Each value
    is 0 for a group inside one node, else its members per node, the NICs its ring
    collectives cross nodes on at once (plan/cluster.group_rails); the gradients' group
    is dp x cp. The layout's worst group of each kind, or with `stage`, for dp, pipeline
    stage `stage`'s own (`stage_data_parallel_link`)."""
    world, gpn = config.world_size, cluster.gpus_per_node
    tp, cp = config.tp, config.cp
    strides = config.strides
    links = {**data_parallel_subgroup_links(config, gpn),
        "ep": group_rails(config.ep, strides["dp"], world, gpn),
        "edp": group_rails(config.expert_data_parallel, config.ep * strides["dp"], world,
                           gpn),
        "tp": group_rails(tp, 1, world, gpn),
        "cp": group_rails(cp, tp, world, gpn),
        "pp": group_rails(config.pp, strides["pp"], world, gpn),
        "dp": group_rails(config.dp, strides["dp"], world, gpn, inner=cp, inner_stride=tp),
    }
    if stage is not None and links["dp"]:
        links["dp"] = stage_data_parallel_link(config, gpn, stage)
    return links


@functools.lru_cache(maxsize=256)
def stage_data_parallel_link(config: ParallelConfig, gpus_per_node: int, stage: int) -> Link:
    """group_links' "dp" entry over the data-parallel (dp x cp) groups of pipeline stage
    `stage` only, one per TP rank. When a replica (pp x cp x tp ranks in minipar's order)
    does not divide a node, replicas straddle nodes and only some stages' groups cross
    (dp 3 x pp 3 on 8-GPU nodes: stage 2's {2, 5, 8} does, stages 0 and 1 stay inside
    node 0); each stage reduces its gradients on its own links, and the slow one's
    reduction can hide in the pipeline's drain where the first stage's cannot."""
    found = [rails([config.rank_at(d, stage, c, t) for d in range(config.dp)
                    for c in range(config.cp)], gpus_per_node) for t in range(config.tp)]
    crossing = [link for link in found if link]
    if not crossing:
        return Link(0, 1)
    return Link(min(crossing), max(link.nodes for link in crossing))


def data_parallel_subgroup_links(config: ParallelConfig, gpus_per_node: int
                                  ) -> dict[str, int]:
    """How the data-parallel sub-groups of ZeRO-3 across nodes cross nodes (those the
    layout has: minipar.distributed.mesh's dp_subgroup, rank 0's group of each kind,
    which the others mirror, placed by the config's rank order), as group_links counts
    it."""
    kinds = {"dp_shard": config.hsdp_shard_size, "dp_replicate": config.hsdp_shard_size,
             "dp_secondary": config.secondary_partition}
    if not any(kinds.values()) and not config.zero_quantized_gradients:
        return {}
    mesh = DeviceMesh(config.dp, config.pp, config.tp, cp=config.cp,
                      world_size=config.world_size, gpus_per_node=gpus_per_node,
                      dp_shard=config.hsdp_shard_size, dp_secondary=config.secondary_partition)
    links = {kind: rails(placed(config, mesh, mesh.dp_subgroup(kind, 0).ranks),
                         gpus_per_node)
             for kind, size in kinds.items() if size}
    if config.zero_quantized_gradients:  # qgZ's levels: by definition
        links |= {"dp_intra_node": 0,
                  "dp_inter_node": int(data_parallel_nodes(config, gpus_per_node) > 1)}
    return links


def transfer_time(transfer: Transfer, cluster: ClusterSpec, crossing: int) -> float:
    """Seconds of one call of `transfer` (alpha-beta; a send is alpha + S/B, on one NIC).
    crossing: its group's entry of group_links (a pipeline send: its own hop's, when
    traffic.py knows it)."""
    if transfer.op == "send":
        crosses = bool(crossing) if transfer.crosses_nodes is None else transfer.crosses_nodes
        alpha, bandwidth = cluster.link(crosses)
        return alpha + transfer.nbytes / bandwidth
    return cluster.collective_time(transfer.op, transfer.group_size, transfer.nbytes,
                                   crossing)


def stage_compute(shape: ModelShape, config: ParallelConfig, stage: StagePlan
                  ) -> dict[str, float]:
    """FLOPs of one micro-batch (forward, backward incl. recomputation, and of the
    backward its weight gradients) and of the optimizer step on one rank of pipeline
    stage `stage`."""
    b, t, sp = config.micro_batch_size, config.tp, config.sequence_parallel
    local = local_shape(shape, config.cp)  # my s/cp tokens of each sequence
    layer_f, layer_b = local.layer_flops(b, t, sp)
    ring_f, ring_b = attention_flops_correction(shape, b, t, config.cp, config.cp_load_balance,
                                                config.flash_attention)
    layer_f, layer_b = layer_f + ring_f, layer_b + ring_b
    forward = stage.layers * layer_f
    backward = stage.layers * layer_b
    moe_layers = stage_moe_layers(shape, stage)
    if moe_layers:  # an MoE layer's experts and router instead of its MLP
        moe_f, moe_b = moe_flops_delta(local, b, t, sp)
        forward, backward = forward + moe_layers * moe_f, backward + moe_layers * moe_b
    recompute = config.recompute
    if recompute.full:  # the checkpointed layers' forward again
        dense_again, moe_again = recomputed_layers(shape, config, stage)
        recompute_flops = (dense_again + moe_again) * layer_f
        if moe_again:
            recompute_flops += moe_again * moe_f
    elif recompute.selective:  # every layer's attention core again
        recompute_flops = stage.layers * shape.attention_core_flops(b, t)
    else:
        recompute_flops = 0.0
    backward += recompute_flops
    # of the backward, the weight gradients, which the zero-bubble schedules split off
    # as W (an MoE layer's counted as a dense one's); a checkpointed layer's recomputed
    # backward makes them with its input's gradient, in B (autograd/checkpoint.py)
    weight = (stage.layers - checkpointed_layers(config, stage)) * local.layer_weight_flops(
        b, t, sp)
    if stage.first:
        f, bw = local.embedding_flops(b, t)
        forward, backward = forward + f, backward + bw
        weight += bw  # B stops at the embedding's output: its backward is all W
    if stage.last:
        f, bw = local.head_flops(b, t, sp)
        forward, backward = forward + f, backward + bw
        weight += local.head_weight_flops(b, t)
    params = stage_parameters(shape, config, stage)
    optimizer_elements = params.numel if config.zero == 0 else min(
        sharded_numel(params, config), params.numel)
    return {"forward": forward, "backward": backward,
            "optimizer": ADAMW_FLOPS_PER_PARAMETER * optimizer_elements,
            "recompute": recompute_flops,  # already in backward
            "weight": weight}  # already in backward


def stage_seconds(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                  stage: StagePlan) -> dict[str, float]:
    """Compute seconds of one micro-batch's forward and backward and of the optimizer step
    on one rank of `stage`: each kernel on the cluster's roofline (GEMMs by shape,
    elementwise by bytes), or every FLOP at the sustained rate on a uniform cluster."""
    if cluster.roofline is None:
        flops = stage_compute(shape, config, stage)
        return {kind: flops[kind] / cluster.sustained_flops for kind in flops}
    roofline = cluster.roofline
    return {kind: sum(times * roofline.total_seconds(kernels) for times, kernels in groups)
            for kind, groups in stage_kernels(shape, config, stage).items()}


def weight_collective_seconds(shape: ModelShape, config: ParallelConfig,
                              cluster: ClusterSpec, stage: StagePlan) -> float:
    """Seconds of one micro-batch's collectives that a split backward's W runs on
    `stage` (parallel/tensor/sequence.py, under sequence parallelism): the inputs of
    QKV and fc1 gathered again for their dW (not a checkpointed layer's, whose weight
    gradients are made in B: shared by layer count, an MoE layer re-gathers one input,
    not two), the logits' input, and on the first stage the embedding gradient's
    all-gather."""
    links, m = group_links(config, cluster), config.micro_batches
    seconds = 0.0
    for transfer in stage_traffic(shape, config, stage, cluster.gpus_per_node):
        spent = transfer.count / m * transfer_time(transfer, cluster, links[transfer.link])
        if transfer.label == INPUT_REGATHER and stage.layers:
            seconds += spent * (1 - checkpointed_layers(config, stage) / stage.layers)
        elif transfer.label in (LOGITS_INPUT_REGATHER, EMBEDDING_GRADIENT_GATHER):
            seconds += spent
    return seconds


def tp_overlap_hidden(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                      stage: StagePlan) -> dict[str, float]:
    """Seconds of one micro-batch's tensor-parallel collectives that --tp-comm-overlap
    hides, forward and backward (Megatron-LM with Transformer Engine's userbuffers,
    Wang et al. 2022 / TE's `ub_overlap_ag` and `ub_overlap_rs`: each sequence-parallel
    all-gather is pipelined with the GEMM that reads its output, each reduce-scatter with
    the GEMM that writes its input, chunk by chunk): as much of the phase's TP time as the
    phase's GEMMs last. What outlasts them stays exposed."""
    if not config.tp_comm_overlap or config.tp == 1:
        return {"forward": 0.0, "backward": 0.0}
    links, m = group_links(config, cluster), config.micro_batches
    comm = {"forward": 0.0, "backward": 0.0}
    for transfer in stage_traffic(shape, config, stage):
        if (transfer.group == "tp" and transfer.phase in comm
                and transfer.label != SEQUENCE_PARALLEL_GRADIENTS):
            comm[transfer.phase] += transfer.count / m * transfer_time(transfer, cluster,
                                                                       links["tp"])
    gemm = {"forward": 0.0, "backward": 0.0}
    for kind, groups in stage_kernels(shape, config, stage).items():
        if kind in gemm:
            gemms = [[k for k in kernels if k.gemm is not None and k.attention is None]
                     for _, kernels in groups]
            gemm[kind] = sum(times * (cluster.roofline.total_seconds(kernels)
                                      if cluster.roofline is not None else
                                      sum(k.flops for k in kernels) / cluster.sustained_flops)
                             for (times, _), kernels in zip(groups, gemms, strict=True))
    return {kind: min(comm[kind], gemm[kind]) for kind in comm}


def ring_seconds(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                 chunk_layers: tuple[int, ...], split: bool = False):
    """Seconds per micro-batch that the ring attention exchanges of a rank's layers
    (`chunk_layers` per model chunk) add on top of their compute: forward, and backward
    with the forward of the layers full recomputation runs again; split: return
    (forward, backward) instead of their sum."""
    layers = sum(chunk_layers)
    if config.cp == 1 or not layers:
        return (0.0, 0.0) if split else 0.0
    b, t, cp, e = config.micro_batch_size, config.tp, config.cp, config.bytes
    heads = b * shape.n_head // t
    c = chunk_tokens(shape.seq_len, cp, config.cp_load_balance)
    if cluster.roofline is None:
        pair = tuple(f / cluster.sustained_flops for f in pair_flops(heads, c, shape.head_dim))
    else:
        pair = tuple(cluster.roofline.total_seconds(k) for k in ring_attention_block_kernels(
            heads, c, shape.head_dim, e.activation, config.flash_attention))
    alpha, bandwidth = cluster.link(group_links(config, cluster)["cp"])
    kv = 2 * b * (shape.seq_len // cp) * (shape.kv_dim // t)  # K and V: the kv heads only
    forward, backward = exposed_ring_seconds(pair, cp, config.cp_load_balance,
                                             alpha + kv * e.activation / bandwidth,
                                             alpha + kv * e.compute / bandwidth,
                                             diagonal_share(c, config.flash_attention))
    recomputed = sum(config.recompute.recomputed_layers(n) for n in chunk_layers)
    forward, backward = layers * forward, layers * backward + recomputed * forward
    return (forward, backward) if split else forward + backward


def overlap_needs_times(config: ParallelConfig) -> bool:
    """Whether the DP reduction's exposed part depends on when backward completes each
    bucket: not when every reduction is waited for, nor for one bucket (complete only
    at the end of backward: all of it is exposed) unless ZeRO-3 prefetches."""
    if config.zero == 3:
        return config.zero3_prefetch or config.overlap_grad_reduce
    return (config.overlap_grad_reduce and config.bucket_size_mb > 0
            or config.overlap_param_gather)


@functools.lru_cache(maxsize=256)  # a pipeline's walk asks for each rank's chunks again
def stage_modules(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                  stage: StagePlan, weight: bool = False) -> tuple[Module, ...]:
    """The modules of `stage` in forward order (embedding, layers, head) with one
    micro-batch's forward and backward seconds each (compute, the ring's exposed part and
    the tensor-parallel collectives they wait for) and their parameters: what
    plan/buckets.py lays into gradient buckets and ZeRO-3 units. The seconds are left
    0 where the reduction does not depend on them (overlap_needs_times). weight: as a
    split backward's W meets them, the "backward" its weight gradients only (each
    gradient then complete at its share of the W: parameter_order.layer_ready)."""
    links, m, t = group_links(config, cluster), config.micro_batches, config.tp
    timed = overlap_needs_times(config)

    def seconds(part: StagePlan, share: float = 1.0) -> tuple[float, float, float]:
        """forward, backward, and the share of the backward in TP collectives."""
        if not timed:
            return 0.0, 0.0, 0.0
        compute = stage_seconds(shape, config, cluster, part)
        if weight:  # W: the weight gradients, and under SP the inputs gathered again
            gathers = weight_collective_seconds(shape, config, cluster, part)
            w = compute["weight"] + gathers
            return compute["forward"] * share, w * share, gathers / w if w > 0 else 0.0
        ring = ring_seconds(shape, config, cluster, part.chunk_layers, split=True)
        out = {"forward": compute["forward"] + ring[0], "backward": compute["backward"] + ring[1]}
        # the backward's own collectives, and the recomputed forward's (before any gradient)
        backward_comm = recomputed_comm = 0.0
        for transfer in stage_traffic(shape, config, part, cluster.gpus_per_node):
            if (transfer.group == "tp" and transfer.phase in out
                    and transfer.label != SEQUENCE_PARALLEL_GRADIENTS):  # (the tail's)
                spent = transfer.count / m * transfer_time(transfer, cluster, links["tp"])
                out[transfer.phase] += spent
                if transfer.phase == "backward" and transfer.label.endswith(RECOMPUTED):
                    recomputed_comm += spent
                elif transfer.phase == "backward":
                    backward_comm += spent
        hidden = tp_overlap_hidden(shape, config, cluster, part)
        for phase in out:
            out[phase] -= hidden[phase]
        # (--tp-comm-overlap hides the backward's collectives alike, the recomputed too)
        if backward_comm + recomputed_comm > 0:
            backward_comm -= hidden["backward"] * backward_comm / (backward_comm
                                                                   + recomputed_comm)
        comm_share = backward_comm / out["backward"] if out["backward"] > 0 else 0.0
        return out["forward"] * share, out["backward"] * share, comm_share

    def part(layers: tuple[int, ...], first: bool = False, last: bool = False) -> StagePlan:
        return StagePlan(rank=stage.rank, chunk_layers=layers, first=first, last=last,
                         tied_copy=False, in_flight=1)

    modules = []
    if stage.first:
        tensors = embedding_tensors(shape, t)
        forward, backward, _ = seconds(part((0,), first=True))
        modules.append(Module("embedding", forward, backward, tensors,
                              embedding_late(shape, t, config.pp)))
    if stage.layers:
        layers = part(stage.chunk_layers)
        n = stage.layers
        forward, backward, comm = seconds(layers, 1 / n)
        tensors = layer_tensors(shape, t)
        flops = stage_compute(shape, config, layers)
        checkpointed = checkpointed_layers(config, layers)
        selective = config.recompute.selective  # the core again, where backward meets it

        collectives = comm * backward  # a layer's own, in its backward proper (B)

        def layer(backward_s: float, again: float = 0.0, core_again: float = 0.0) -> Module:
            shares = ((comm, 0.0) if weight or backward_s <= 0 else
                      (collectives / backward_s, again / backward_s))
            ready = layer_ready(local_shape(shape, config.cp), config.micro_batch_size, t,
                                config.sequence_parallel, *shares, weight, core_again)
            return Module("layer", forward, backward_s, tensors, (False,) * len(tensors),
                          ready, recompute_s=again)

        if selective:  # every layer alike: one Module, met n times
            plain = checkpoint = layer(backward, core_again=flops["recompute"] / n)
        elif weight:  # W: a checkpointed layer made its weight gradients in B
            # (autograd/checkpoint.py runs a whole inner backward), so its W runs nothing
            plain = layer(backward * n / (n - checkpointed) if checkpointed < n else 0.0)
            checkpoint = replace(plain, backward_s=0.0)
        else:  # full recomputation: a checkpoint's forward again, its collectives
            # too, before its backward proper (backward averages it over the layers)
            again = (forward * flops["recompute"] / checkpointed / (flops["forward"] / n)
                     if checkpointed and flops["forward"] else 0.0)
            plain = layer(backward - again * checkpointed / n)
        checkpoints = {}  # layers of a checkpoint -> its last layer's Module (alike ones
        # are one object: buckets.gradient_buckets cuts a run of them once)
        for chunk in stage.chunk_layers:  # each chunk's checkpoints (nn/recompute.py)
            for start, end, recomputed in config.recompute.segments(chunk):
                group = end - start  # (uniform: k layers; block: one)
                if not recomputed or selective:
                    modules += [plain] * group
                elif weight:
                    modules += [checkpoint] * group
                else:  # the checkpoint's forward again, before its last layer's backward
                    if group not in checkpoints:
                        checkpoints[group] = layer(plain.backward_s + group * again,
                                                   group * again)
                    modules += [plain] * (group - 1) + [checkpoints[group]]
    if stage.last:
        tensors, late = head_tensors(shape, t, stage.tied_copy)
        forward, backward, comm = seconds(part((0,), last=True))
        modules.append(Module("head", forward, backward, tensors, late,
                              None if weight else  # W: the logits' dW, then ln_f's
                              head_ready(shape, config.micro_batch_size, t, tensors, comm)))
    return tuple(modules)


def data_parallel_seconds(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                          stage: StagePlan) -> dict:
    """plan/overlap.py's data-parallel time of one rank of `stage` (see
    data_parallel_time) on this cluster's DP links."""
    modules = (stage_modules(shape, config, cluster, stage)
               if config.replicas > 1 and not shape.is_moe and overlap_modelled(config)
               else [])
    return data_parallel_time(modules, config, dp_collective(config, cluster),
                              shape.tie_embeddings)


def dp_collective(config: ParallelConfig, cluster: ClusterSpec, stage: int | None = None):
    """`collective(op, nbytes, group="dp")` -> seconds of a ring collective of nbytes over
    the data-parallel group, or HSDP's shard ("dp_shard") or replicate ("dp_replicate")
    group, each on the links it crosses (pipeline stage `stage`'s: group_links): the
    pricing overlap.py is handed."""
    links = group_links(config, cluster, stage)
    sizes = {"dp": config.replicas, "dp_shard": config.sharding_group,
             "dp_replicate": config.replicas // config.sharding_group}

    def collective(op: str, nbytes: float, group: str = "dp") -> float:
        return cluster.collective_time(op, sizes[group], nbytes, links[group])

    return collective


def overlap_modelled(config: ParallelConfig) -> bool:
    """Whether overlap.py times this layout's ZeRO-3: not its variants over sub-groups
    (HSDP, ZeRO++, FSDP2's reshard to K ranks), priced as they block. FSDP2's
    reshard_after_forward=False keeps ZeRO-3's group and order, and overlap.py runs
    its recurrence with the forward's units kept gathered; HSDP runs it over the shard
    group, with the last micro-batch's all-reduces over the replicas."""
    return all(name == "hsdp_shard_size"
               or (name == "reshard_after_forward" and config.reshard_after_forward is False)
               for name in config.sharding_across_nodes())


def overlap_contention_seconds(config: ParallelConfig, cluster: ClusterSpec,
                               hidden_s: float) -> float:
    """Seconds the compute loses to `hidden_s` seconds of data-parallel collectives that
    ran beside it: cluster.overlap_contention x the collectives' rate as a share of
    NVLink's (ClusterSpec.nvlink_rate_share) x hidden_s. NCCL's ring kernels copy with
    SMs and through HBM, which the GEMMs they overlap also use: measured on an H100, a
    GEMM sized to one wave of 132 SMs took nearly twice as long beside a 24-block NCCL
    all-gather (NVIDIA developer forum, "Compute-communication overlap causes severe
    GEMM performance degradation because of tail effect", 2025), and overlapped compute
    ran 18.9% slower on average, 40% at most, on H100, A100 and MI250 (Hassan et al.
    2025, arXiv 2507.03114)."""
    if not hidden_s or not cluster.overlap_contention:
        return 0.0
    # what hides is ZeRO's traffic, over HSDP's shard group when it has one
    crossing = group_links(config, cluster)["dp_shard" if config.hsdp_shard_size else "dp"]
    return cluster.overlap_contention * cluster.nvlink_rate_share(crossing) * hidden_s


def overlap_priced(transfer: Transfer, shape: ModelShape, config: ParallelConfig) -> bool:
    """The DP transfers plan/overlap.py times (all but the gradient norm's). An MoE
    model's two engines (dense over DP, experts over dp / ep) and ZeRO-3's variants over
    sub-groups (`overlap_modelled`) are not in overlap.py's model: their transfers are
    priced as they block (traffic.py), an upper bound."""
    return (transfer.group in DP_GROUPS and transfer.label != GRADIENT_NORM
            and not shape.is_moe and overlap_modelled(config))


def stage_time(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
               stage: StagePlan, transfers: list[Transfer]) -> dict[str, float]:
    """Seconds of one micro-batch (t_r) and of the step's tail on one rank; the
    data-parallel reduction and gathers only as far as they are exposed (overlap.py)."""
    flops = stage_compute(shape, config, stage)
    compute_s = stage_seconds(shape, config, cluster, stage)
    links = group_links(config, cluster)
    m = config.micro_batches
    per_micro_comm = step_comm = p2p = 0.0
    per_micro_comm += ring_seconds(shape, config, cluster, stage.chunk_layers)
    data_parallel = data_parallel_seconds(shape, config, cluster, stage)
    per_micro_comm += data_parallel["per_micro_batch_s"]
    step_comm += (data_parallel["last_backward_s"] + data_parallel["late_s"]
                  + data_parallel["after_step_s"])
    for transfer in transfers:
        seconds = transfer_time(transfer, cluster, links[transfer.link])
        if transfer.group == "cp" or overlap_priced(transfer, shape, config):  # counted above
            continue
        if transfer.op == "send":
            p2p = max(p2p, seconds)
        elif transfer.phase == "step" or transfer.label == SEQUENCE_PARALLEL_GRADIENTS:
            step_comm += transfer.count * seconds
        else:
            per_micro_comm += transfer.count * seconds / m
    per_micro_comm -= sum(tp_overlap_hidden(shape, config, cluster, stage).values())
    compute = compute_s["forward"] + compute_s["backward"]
    offload = offload_time(shape, config, cluster, stage)
    return {
        "micro_batch_compute_s": compute,
        "micro_batch_comm_s": per_micro_comm,
        "micro_batch_offload_s": offload["micro_s"] / m,
        "micro_batch_s": compute + per_micro_comm + offload["micro_s"] / m,
        # compute lost to the data-parallel collectives it hid, per step (in the tail:
        # once a step, whatever the schedule)
        "overlap_contention_s": overlap_contention_seconds(config, cluster,
                                                           data_parallel["hidden_s"]),
        "p2p_s": p2p,
        "step_comm_s": step_comm,
        # communication the rank waits for per step (HTA's exposed communication), and
        # the data-parallel transfers' time whether hidden or not
        "exposed_comm_s": m * per_micro_comm + step_comm,
        "dp_comm_s": data_parallel["comm_s"] + sum(
            t.count * transfer_time(t, cluster, links[t.link]) for t in transfers
            if t.group in DP_GROUPS and t.label != GRADIENT_NORM
            and (shape.is_moe or not overlap_modelled(config))),
        "dp_buckets": data_parallel["buckets"],
        "optimizer_s": optimizer_seconds(config, compute_s, offload),
        "host_optimizer_s": offload["host_optimizer_s"],
        "flops": flops,
    }


def optimizer_seconds(config: ParallelConfig, compute_s: dict, offload: dict) -> float:
    """The step's optimizer time: AdamW on the GPU, or, offloaded (plan/offload.py), the
    exposed gradient copy, CPU Adam and the copies of the step."""
    gpu = compute_s["optimizer"] if config.offload_optimizer == "none" else 0.0
    return gpu + offload["gradient_s"] + offload["step_s"]


def step_time(config: ParallelConfig, stage_times: list[dict], shape: ModelShape,
              cluster: ClusterSpec, stage_ranks: list[int]) -> dict[str, float]:
    """Step time, bubble and MFU from the representative ranks' stage times."""
    p, m, v = config.pp, config.micro_batches, config.virtual_stages
    per_micro = [s["micro_batch_s"] for s in stage_times]
    slowest = max(per_micro)
    # Sum over all p ranks, with the inner ranks like the representative inner rank.
    by_rank = dict(zip(stage_ranks, per_micro, strict=True))
    inner = by_rank.get(1, slowest)
    total_over_ranks = sum(by_rank.get(r, inner) for r in range(p))
    hop = max(s["p2p_s"] for s in stage_times)
    if p == 1:
        pipeline = m * slowest
    elif v == 1:
        pipeline = total_over_ranks + (m - 1) * slowest + 2 * (p - 1) * hop
    else:
        # m t / (1 - bubble): (m + (p - 1)/v) t for the interleaved schedule
        bubble = uniform_bubble_fraction(config.schedule, p, m, v)
        pipeline = m * slowest / (1 - bubble) + 2 * (p - 1) * hop
    tail = max(s["step_comm_s"] + s["optimizer_s"] + s["overlap_contention_s"]
               for s in stage_times)
    step = pipeline + tail
    busy = m * total_over_ranks / p  # mean busy time of a rank in the pipeline section
    bubble = 0.0 if p == 1 else max(0.0, 1 - busy / pipeline)
    model_flops = shape.model_flops_per_sequence() * config.global_batch_size
    return {
        "step_s": step,
        "pipeline_s": pipeline,
        "tail_s": tail,
        "bubble_fraction": bubble,
        "model_flops": model_flops,
        "mfu": model_flops / (step * config.world_size * cluster.peak_flops),
        "tokens_per_s": config.global_batch_size * shape.seq_len / step,
    }
