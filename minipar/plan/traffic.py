"""Predicted communication of one rank per optimizer step: every collective it joins.

A plan's traffic is a list of `Transfer`s (op, group kind, full tensor bytes, how many
times per step, bytes this rank sends each time). Summing `sent` by group gives the
report's comm.by_group; the op and the tensor size give the alpha-beta time.

Data parallelism (group "dp", once per step unless noted):
    ZeRO-0    all-reduce of the gradients                     2(N-1)/N 2Psi   (DDP)
    ZeRO-1    reduce-scatter of the gradients, all-gather of the parameters: the same
              2(N-1)/N 2Psi (Rajbhandari et al. 2020, section 7.2.1)
    ZeRO-2    the reduce-scatter on every micro-batch (DeepSpeed reduces each
              micro-batch's gradients into the shard), the all-gather once
    ZeRO-3    every micro-batch: an all-gather of each unit before its forward and again
              before its backward (the ZeRO paper's 1.5x of DP: 3 (N-1)/N 2Psi), a
              reduce-scatter of each unit's gradients; with a tied LM head the embedding
              is gathered once more for the head. No all-gather after the step.
    ZeRO-1..3 also all-reduce one fp64 number, the squared gradient norm, for clipping.
Tensor parallelism (group "tp", per micro-batch; Shoeybi et al. 2019, section 3):
    each layer all-reduces the (b, s, h) activation twice forward (g after attention and
    MLP) and its gradient twice backward (f before them); the vocabulary-parallel
    embedding once forward, the logits' input once backward, and the cross-entropy
    two (b, s) statistics forward. With sequence parallelism (Korthikanti et al. 2022,
    section 4.2.2) each all-reduce becomes an all-gather plus a reduce-scatter, the
    column-parallel layers gather their input again in backward, and the norms' and
    row-parallel biases' gradients are all-reduced, all of them in one flat buffer once
    per step at the end of the last backward (Megatron's finalize_model_grads; per
    vector and micro-batch with an offloaded optimizer). Recomputation repeats the
    forward's.
Pipeline parallelism (group "pp", per micro-batch; Narayanan et al. 2021, section 2.2):
    each chunk sends its (b, s, h) output forward and its input's gradient back; per step
    the first and last rank all-reduce the tied embedding's gradient (Megatron's
    embedding group) and the last rank broadcasts the loss (one fp64 number).
Expert parallelism (group "ep", per micro-batch; plan/experts.py): four all-to-alls of
the (E, C, d) dispatch buffer per MoE layer, dispatch and combine forward and again
backward, each sending (ep-1)/ep of it; the non-expert gradients are reduced over DP as
above, the experts' over the expert-data-parallel group (dp / ep ranks, booked as "dp"
like the emulator's kind, priced on that group's link), and the experts' squared norm is
all-reduced over the ep group too (each ep rank holds different experts).
Context parallelism (group "cp", per micro-batch; minipar/plan/context.py): each layer's
ring attention sends (N-1) K/V blocks of my s/N tokens forward, and in backward the K/V
again and the dK/dV partial sums (in the compute dtype); recomputation repeats the
forward's. Data parallelism's group is then dp x cp (the parameters' replicas), and the
TP and PP volumes are those of s/N tokens.
Gradient clipping (per step): each rank sums the squares of the gradient elements it
counts (TP replicas on TP rank 0, a tied embedding on the first stage), then all-reduces
that fp64 number over DP (ZeRO-1..3 only: DDP's gradients are already replicated), over
TP and over PP, in that order (minipar.parallel.data.ddp.sum_over_groups; Megatron-LM's
clip_grad_norm_fp32 all-reduces over its model-parallel group).
ZeRO-3 across nodes (docs/data-parallel-and-zero.md; the emulator's zero/hybrid.py,
reshard.py, quantized.py), booked under the emulator's data-parallel sub-group kinds:
HSDP shards over its "dp_shard" group of K and all-reduces my gradient shard over the
"dp_replicate" group once per step; FSDP2's reshard_after_forward=False gathers each
unit once per micro-batch (the backward and a tied head reuse it); K (and ZeRO++'s hpZ)
gathers over all N ranks for a unit's first use, then its 1/K piece over the
"dp_secondary" group of K (FSDP2: the first use of every micro-batch; hpZ keeps the
piece until the step: of the first micro-batch only); qwZ sends every gather as int8
values and fp32 block scales (two all-gathers); qgZ replaces the reduce-scatter by an
int4 all-to-all inside each node ("dp_intra_node") and one across nodes
("dp_inter_node"), blocks and scales together. Long because it holds every group's
collectives, one section each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minipar.distributed.mesh import DeviceMesh
from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.parallel.zero.quantize import GRADIENT_BLOCK, WEIGHT_BLOCK, quantized_nbytes
from minipar.plan.cluster import (
    all_gather_sent,
    all_reduce_sent,
    broadcast_sent,
    reduce_scatter_sent,
)
from minipar.plan.context import local_shape, ring_attention_bytes
from minipar.plan.experts import (
    all_to_all_sent_per_call,
    buffer_bytes,
    dispatch_rows,
    recomputed_layers,
    stage_moe_layers,
)
from minipar.plan.layout import ParallelConfig, StagePlan
from minipar.plan.memory import (
    flat_buffers,
    sequence_parallel_gradient_elements,
    sequence_parallel_vectors,
    shard,
    shard_pieces,
    stage_parameters,
)
from minipar.plan.placement import replica_hops_crossing, stage_holders
from minipar.plan.shapes import ModelShape, padded_vocab

NORM_BYTES = 8  # one fp64 number: a squared gradient norm or the loss
GRADIENT_NORM = "gradient norm"  # the label of the clipping's all-reduces (dp, tp, pp)
PARAMETER_ALL_GATHER = "parameter all-gather"  # ZeRO-1/2's, after the optimizer
# Sequence parallelism's norm and bias gradients, summed over TP once per step at the end
# of the last backward: on the clock, part of the step's tail (timing.py)
SEQUENCE_PARALLEL_GRADIENTS = "norm and bias gradient all-reduce (coalesced)"
# what ends the label of a collective full recomputation's forward runs again, in backward
RECOMPUTED = ", recomputed"
# sequence parallelism's all-gathers of a layer's (or the logits') input again for the
# weight gradient: a split backward runs them in its W (parallel/tensor/sequence.py)
INPUT_REGATHER = "input re-gather"
LOGITS_INPUT_REGATHER = "logits input re-gather"
# the first stage's scatter after the embedding sits below the chunk's input, so a split
# backward runs its gradient's all-gather in W too (nn/gpt.py's embed)
EMBEDDING_GRADIENT_GATHER = "embedding gradient gather"


@dataclass(frozen=True)
class Transfer:
    """One kind of collective a rank joins.

    op: all_reduce | all_gather | reduce_scatter | broadcast | send | all_to_all;
    group: dp | tp | pp | cp | ep (the report's comm.by_group kind); group_size: ranks
    in it; nbytes: the full tensor S (what the alpha-beta time uses; for a send, the
    message); count: calls per optimizer step; sent: bytes this rank sends per call;
    phase: forward | backward (every micro-batch) | step (after the last backward).
    Sends are isends overlapping compute; the rest block the rank. link_group: the group
    whose link prices it when not `group`'s ("edp": the expert gradients, booked as dp);
    crosses_nodes: a pipeline send's own hop (placement.replica_hops_crossing), which a
    pipeline whose stages share nodes prices apart from the pp group's link.
    """

    op: str
    group: str
    group_size: int
    nbytes: float
    count: int
    sent: int
    phase: str
    label: str
    link_group: str | None = None
    crosses_nodes: bool | None = None

    @property
    def link(self) -> str:
        """The key of timing.group_links this transfer's link crossing is read from."""
        return self.link_group or self.group

    @property
    def sent_per_step(self) -> int:
        return self.count * self.sent


def stage_traffic(shape: ModelShape, config: ParallelConfig, stage: StagePlan,
                  gpus_per_node: int = 8) -> list[Transfer]:
    """Every transfer of the first rank (dp 0, tp 0) of pipeline stage `stage`
    (gpus_per_node: the cluster's, which places qgZ's two levels)."""
    local = local_shape(shape, config.cp)  # activations: my s/cp tokens
    return (_data_parallel(shape, config, stage, gpus_per_node)
            + _tensor_parallel(local, config, stage, shape)
            + _pipeline(shape, config, stage, gpus_per_node)
            + _context_parallel(shape, config, stage)
            + _expert_parallel(local, config, stage))


def sent_by_group(transfers: list[Transfer]) -> dict[str, int]:
    """Bytes sent per step by group kind (the data-parallel sub-groups of ZeRO-3 across
    nodes, minipar.distributed.mesh.DP_SUBGROUPS, only when the layout has them)."""
    totals = {"dp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0}
    for transfer in transfers:
        totals[transfer.group] = totals.get(transfer.group, 0) + transfer.sent_per_step
    return totals


# ------------------------------------------------------------------ data parallel
def placed(config, mesh: DeviceMesh, ranks) -> list[int]:
    """minipar mesh ranks at the world ranks the config's rank order gives them
    (ParallelConfig.rank_at)."""
    return [config.rank_at(**mesh.coords(rank)) for rank in ranks]


def data_parallel_nodes(config, gpus_per_node: int) -> int:
    """Nodes the data-parallel group (dp x cp) of rank 0 spans, under the config's rank
    order."""
    mesh = DeviceMesh(config.dp, config.pp, config.tp, cp=config.cp,
                      world_size=config.world_size, gpus_per_node=gpus_per_node)
    return len({rank // gpus_per_node
                for rank in placed(config, mesh, mesh.data_parallel_group(0).ranks)})


def _data_parallel(shape, config, stage, gpus_per_node) -> list[Transfer]:
    m, zero = config.micro_batches, config.zero
    nbytes = config.bytes
    g, p = nbytes.grad, nbytes.param
    params = stage_parameters(shape, config, stage)
    transfers = []
    if config.ep > 1 and shape.is_moe:  # the experts' engine sums its squared norm over
        # its own tp, pp and ep groups (train/engines.expert_data_parallel_engine), even
        # under DDP; a stage without MoE layers adds its 0 to the same all-reduces
        for group, size, position in (("tp", config.tp, 0), ("pp", config.pp, stage.rank),
                                      ("ep", config.ep, 0)):
            if size > 1:
                transfers.append(Transfer("all_reduce", group, size, NORM_BYTES, 1,
                                          all_reduce_sent(1, NORM_BYTES, size, position),
                                          "step", GRADIENT_NORM))
    if zero == 3:
        return _zero3(shape, config, stage, params, gpus_per_node)
    for i, ((numel, n), (piece, _)) in enumerate(zip(flat_buffers(params, config),
                                                     shard_pieces(params, config),
                                                     strict=True)):
        if n == 1:
            continue
        link = "edp" if i == 1 else None  # the second buffer: the experts'
        if zero == 0:
            transfers.append(Transfer("all_reduce", "dp", n, numel * g, 1,
                                      all_reduce_sent(numel, g, n), "step",
                                      "gradient all-reduce", link))
            continue
        reduce_count, reduce_phase = (1, "step") if zero == 1 else (m, "backward")
        transfers += [
            Transfer("reduce_scatter", "dp", n, piece * n * g, reduce_count,
                     reduce_scatter_sent(piece * n, g, n), reduce_phase,
                     "gradient reduce-scatter", link),
            Transfer("all_reduce", "dp", n, NORM_BYTES, 1, all_reduce_sent(1, NORM_BYTES, n),
                     "step", GRADIENT_NORM, link),
            Transfer("all_gather", "dp", n, piece * n * p, 1, all_gather_sent(piece, p, n),
                     "step", PARAMETER_ALL_GATHER, link),
        ]
    return transfers


def _zero3(shape, config, stage, params, gpus_per_node) -> list[Transfer]:
    """ZeRO-3's transfers, and those of its variants across nodes (the module docstring's
    last paragraph)."""
    if config.replicas == 1:
        return []
    n, m = config.sharding_group, config.micro_batches
    g, p = config.bytes.grad, config.bytes.param
    kind = "dp_shard" if config.hsdp_shard_size else "dp"
    secondary = config.secondary_partition
    keep = config.reshard_after_forward is not False  # False: kept from forward to backward
    transfers = []

    def gather(group, size, piece, count, phase, label):
        if size > 1 and count:
            if config.zero_quantized_weights:  # qwZ: int8 blocks and their fp32 scales
                scales = quantized_nbytes(piece, 8, WEIGHT_BLOCK) - piece
                for part, nbytes in (("int8", piece), ("scales", scales)):
                    transfers.append(Transfer("all_gather", group, size, nbytes * size, count,
                                              all_gather_sent(nbytes, 1, size), phase,
                                              f"{label} (qwZ {part})"))
            else:
                transfers.append(Transfer("all_gather", group, size, piece * size * p, count,
                                          all_gather_sent(piece, p, size), phase, label))

    tied_head = shape.tie_embeddings and stage.first and stage.last
    # Alike units counted once (a deep model's layers): the same transfers, in the same
    # order, as one pair per unit merged (_merge), without making 2 x 4096 of them.
    units: dict[tuple[int, int], int] = {}  # (elements, the head's use of wte) -> units
    for i, unit in enumerate(params.units):
        again = 1 if stage.first and i == 0 and tied_head else 0  # the head's use of wte
        units[unit, again] = units.get((unit, again), 0) + 1
    for (unit, again), alike in units.items():
        piece = shard(unit, n)
        if secondary is None:  # True: forward, backward (and the head) gather over n
            gather(kind, n, piece, ((2 + again) * m if keep else m) * alike, "forward",
                   "ZeRO-3 parameter all-gather")
        else:  # the first use gathers over n, the others my 1/K piece over K
            piece_k = piece * n // secondary
            until_step = config.zero_hpz_partition_size > 1  # hpZ keeps it until the step
            firsts = 1 if until_step else m
            gather(kind, n, piece, firsts * alike, "forward", "ZeRO-3 parameter all-gather")
            gather("dp_secondary", secondary, piece_k, (m - firsts + again * m) * alike,
                   "forward", "secondary partition all-gather")
            gather("dp_secondary", secondary, piece_k, m * alike, "backward",
                   "secondary partition all-gather")
        transfers += [replace(t, count=t.count * alike)
                      for t in _zero3_gradient_reduction(config, kind, n, piece, gpus_per_node)]
        replicas = config.replicas // n  # HSDP: each unit's gradient shard averaged over
        if config.hsdp_shard_size and replicas > 1:  # its replicas, once per step
            transfers.append(Transfer("all_reduce", "dp_replicate", replicas, piece * g, alike,
                                      all_reduce_sent(piece, g, replicas), "step",
                                      "HSDP gradient all-reduce over the replicas"))
    if n > 1:
        transfers.append(Transfer("all_reduce", kind, n, NORM_BYTES, 1,
                                  all_reduce_sent(1, NORM_BYTES, n), "step", GRADIENT_NORM))
    return _merge(transfers)


def _zero3_gradient_reduction(config, kind, n, piece, gpus_per_node) -> list[Transfer]:
    """One unit's gradient reduce-scatter per micro-batch: a ring over the n ranks, or
    qgZ's int4 all-to-all inside each node (L ranks), then across the Q nodes."""
    m, g = config.micro_batches, config.bytes.grad
    nodes = data_parallel_nodes(config, gpus_per_node) if config.zero_quantized_gradients else 1
    if not config.zero_quantized_gradients or nodes == 1:
        if n == 1:
            return []
        return [Transfer("reduce_scatter", kind, n, piece * n * g, m,
                         reduce_scatter_sent(piece * n, g, n), "backward",
                         "ZeRO-3 gradient reduce-scatter")]
    local = n // nodes
    values = quantized_nbytes(piece, 4, GRADIENT_BLOCK) - 4 * -(-piece // GRADIENT_BLOCK)
    transfers = []
    for part, nbytes in (("int4", values), ("scales", quantized_nbytes(piece, 4,
                                                                        GRADIENT_BLOCK) - values)):
        transfers += [Transfer("all_to_all", "dp_intra_node", local, local * nodes * nbytes, m,
                               (local - 1) * nodes * nbytes, "backward",
                               f"qgZ gradient all-to-all inside the node ({part})"),
                      Transfer("all_to_all", "dp_inter_node", nodes, nodes * nbytes, m,
                               (nodes - 1) * nbytes, "backward",
                               f"qgZ gradient all-to-all across nodes ({part})")]
    return transfers


# ------------------------------------------------------------------ tensor parallel
def _tensor_parallel(shape, config, stage, model) -> list[Transfer]:
    """shape: my s/cp tokens' (the activations'); model: the whole model's (the
    parameters', whose flat buffers place the norm and bias gradients)."""
    t = config.tp
    if t == 1:
        return []
    nbytes = config.bytes
    a, c = nbytes.activation, nbytes.compute
    m, b, s, h = config.micro_batches, config.micro_batch_size, shape.seq_len, shape.d_model
    numel = b * s * h  # the full (b, s, h) activation
    piece = numel // t
    layers = stage.layers
    # g twice per layer, and again in each layer full recomputation runs a second time
    # (selective recomputation redoes the attention core only: no communication)
    recompute = config.recompute
    recomputed = sum(recompute.recomputed_layers(n) for n in stage.chunk_layers)
    transfers = []

    def add(op, count, nbytes_full, sent, phase, label):
        if count:
            transfers.append(Transfer(op, "tp", t, nbytes_full, count * m, sent, phase, label))

    # An MoE layer's MLP collectives are its experts' (minipar/parallel/tensor/model.py
    # tensor_parallel_experts): each local expert all-reduces its (ep x C, d) partial
    # output (g) and its input's gradient (f); with sequence parallelism the layer
    # all-gathers its input first and its output's gradient in backward.
    # Full recomputation runs an MoE layer's experts (and their g) again too.
    moe = stage_moe_layers(shape, stage)
    dense_again, moe_again = recomputed_layers(shape, config, stage)
    if moe:
        experts = shape.moe_num_experts // config.ep
        rows = dispatch_rows(shape, b) // shape.moe_num_experts * config.ep
        expert = all_reduce_sent(rows * h, a, t)
        add("all_reduce", experts * moe, rows * h * a, expert, "forward",
            "expert output all-reduce (g)")
        add("all_reduce", experts * moe_again, rows * h * a, expert, "backward",
            "expert output all-reduce (g)" + RECOMPUTED)
        add("all_reduce", experts * moe, rows * h * a, expert, "backward",
            "expert input-gradient all-reduce (f)")
    if not config.sequence_parallel:
        full = all_reduce_sent(numel, a, t)
        add("all_reduce", 2 * layers - moe, numel * a, full, "forward",
            "layer output all-reduce (g)")
        add("all_reduce", 2 * dense_again + moe_again, numel * a, full, "backward",
            "layer output all-reduce (g)" + RECOMPUTED)
        add("all_reduce", 2 * layers - moe, numel * a, full, "backward",
            "layer input-gradient all-reduce (f)")
        if stage.first:
            add("all_reduce", 1, numel * a, full, "forward", "vocab-parallel embedding")
        if stage.last:
            add("all_reduce", 1, numel * a, full, "backward", "logits input gradient")
    else:
        gather, scatter = all_gather_sent(piece, a, t), reduce_scatter_sent(numel, a, t)
        # under FP8, Transformer Engine gathers the FP8 copies of the norms' outputs and
        # of the row-parallel layers' output gradients, 1 byte an element (plan/fp8.py)
        g = 1 if config.fp8_format is not None else a
        layer_gather = all_gather_sent(piece, g, t)
        add("all_gather", 2 * layers, numel * g, layer_gather, "forward",
            "sequence-parallel all-gather (g)")
        add("reduce_scatter", 2 * layers - moe, numel * a, scatter, "forward",
            "sequence-parallel reduce-scatter")
        # the checkpointed layers' forward again, run in backward before their gradients
        add("all_gather", 2 * recomputed, numel * g, layer_gather, "backward",
            "sequence-parallel all-gather (g)" + RECOMPUTED)
        add("reduce_scatter", 2 * dense_again + moe_again, numel * a, scatter, "backward",
            "sequence-parallel reduce-scatter" + RECOMPUTED)
        # backward all-gathers the inputs of QKV and fc1 again for their weight
        # gradients (Korthikanti et al.'s extra all-gather; an MoE layer's experts take
        # theirs whole) and the output gradients of the row-parallel layers (g-bar)
        add("all_gather", 2 * layers - moe, numel * g, layer_gather, "backward",
            INPUT_REGATHER)
        add("all_gather", 2 * layers, numel * g, layer_gather, "backward",
            "output-gradient all-gather")
        add("reduce_scatter", 2 * layers - moe, numel * a, scatter, "backward",
            "input-gradient reduce-scatter")
        vectors = sequence_parallel_vectors(shape, stage)
        if config.offload_optimizer == "none":
            # one flat all-reduce of them all per step, after the DP sync (Megatron's
            # finalize_model_grads; minipar/parallel/tensor/sequence.py)
            elements = sequence_parallel_gradient_elements(model, config, stage)
            transfers.append(Transfer(
                "all_reduce", "tp", t, elements * nbytes.grad, 1,
                all_reduce_sent(elements, nbytes.grad, t), "backward",
                SEQUENCE_PARALLEL_GRADIENTS))
        else:  # (an offloaded optimizer keeps f's all-reduce per vector and micro-batch,
            # of the micro-batch's gradient: in the parameters' dtype, before accumulation)
            add("all_reduce", vectors, h * nbytes.param, all_reduce_sent(h, nbytes.param, t),
                "backward", "norm and bias gradient all-reduce")
        if stage.first:
            add("all_reduce", 1, numel * a, all_reduce_sent(numel, a, t), "forward",
                "vocab-parallel embedding")
            add("all_gather", 1, numel * a, gather, "backward", EMBEDDING_GRADIENT_GATHER)
        if stage.last:
            add("all_gather", 1, numel * a, gather, "forward", "logits input all-gather")
            add("all_gather", 1, numel * a, gather, "backward", LOGITS_INPUT_REGATHER)
            add("reduce_scatter", 1, numel * a, scatter, "backward",
                "logits input-gradient reduce-scatter")
    if stage.last:  # vocabulary-parallel cross-entropy: max, then (sum exp, target logit)
        tokens = b * s
        add("all_reduce", 1, tokens * c, all_reduce_sent(tokens, c, t), "forward",
            "cross-entropy max")
        add("all_reduce", 1, 2 * tokens * c, all_reduce_sent(2 * tokens, c, t), "forward",
            "cross-entropy sums")
    transfers.append(Transfer("all_reduce", "tp", t, NORM_BYTES, 1,
                              all_reduce_sent(1, NORM_BYTES, t), "step", GRADIENT_NORM))
    return transfers


# ------------------------------------------------------------------ pipeline
def pipeline_message_bytes(shape: ModelShape, config: ParallelConfig) -> int:
    """Bytes of one pipeline message a rank sends: a micro-batch's (b, s, h) activation
    or its gradient, of its s / cp tokens (s / (cp tp) with sequence parallelism)."""
    tokens = config.micro_batch_size * local_shape(shape, config.cp).seq_len
    if config.sequence_parallel:
        tokens //= config.tp
    return tokens * shape.d_model * config.bytes.activation


def _pipeline_hops(config, rank: int, gpus_per_node: int, received: bool = False):
    """(phase, label, whether the hop crosses nodes, messages per micro-batch) of what
    pipeline rank `rank` sends, or with `received` receives: each chunk sends its
    activation forward and its input's gradient back unless the neighbouring virtual
    stage is on this rank too (the tip of a V: handed over in memory,
    minipar/parallel/pipeline/split_backward.py), and receives what its neighbours send
    it. Each hop is priced as its ranks lie (a pipeline whose stages share nodes crosses
    between them on some hops only), in the replica where most of this rank's hops cross
    (placement.replica_hops_crossing)."""
    p, v = config.pp, config.virtual_stages
    spec = SCHEDULES[config.schedule]
    holder = stage_holders(spec.placement, p, v)
    mine = {spec.virtual_stage(p, rank, c) for c in range(v)}
    mine_hops = {(a, b) for peer in ((rank - 1) % p, (rank + 1) % p)
                 for a, b in ((rank, peer), (peer, rank))}
    crossing = max(replica_hops_crossing(config, gpus_per_node),
                   key=lambda hops: len(hops & mine_hops))
    for phase, label, step in (("forward", "activation", 1), ("backward", "gradient", -1)):
        if received:  # what the neighbour before me (in this phase's direction) sends
            step = -step
        peers = [holder[s + step] for s in sorted(mine)
                 if 0 <= s + step < p * v and s + step not in mine]
        hops = [(peer, rank) if received else (rank, peer) for peer in peers]
        for crosses in (False, True):
            count = sum((hop in crossing) == crosses for hop in hops)
            if count:
                yield phase, label, crosses, count


def pipeline_receives(shape, config, rank: int, cluster) -> list[Transfer]:
    """The pipeline messages rank `rank` receives per step, as its neighbours' sends
    (sent 0: the ledger books bytes where they leave). A message occupies both ends, so
    a rank's time in the pp group is its sends and these."""
    if config.pp == 1:
        return []
    message, m = pipeline_message_bytes(shape, config), config.micro_batches
    return [Transfer("send", "pp", 2, message, count * m, 0, phase, f"{label} receive",
                     crosses_nodes=crosses)
            for phase, label, crosses, count in _pipeline_hops(
                config, rank, cluster.gpus_per_node, received=True)]


def _pipeline(shape, config, stage, gpus_per_node) -> list[Transfer]:
    p = config.pp
    if p == 1:
        return []
    nbytes = config.bytes
    m, v = config.micro_batches, config.virtual_stages
    message = pipeline_message_bytes(shape, config)
    transfers = [Transfer("send", "pp", 2, message, count * m, message, phase,
                          f"{label} send", crosses_nodes=crosses)
                 for phase, label, crosses, count in _pipeline_hops(config, stage.rank,
                                                                    gpus_per_node)]
    # (a V puts the first and last stage on one rank, whose chunks share one wte)
    if shape.tie_embeddings and (stage.first or stage.last) and not (stage.first
                                                                      and stage.last):
        rows = padded_vocab(shape.vocab_size, config.tp) // config.tp * shape.d_model
        position = 0 if stage.first else 1
        transfers.append(Transfer("all_reduce", "pp", 2, rows * nbytes.grad, 1,
                                  all_reduce_sent(rows, nbytes.grad, 2, position), "step",
                                  "tied embedding gradient all-reduce"))
    # along the chain from the rank that holds the last stage (rank 0 in a V)
    loss_rank = stage_holders(SCHEDULES[config.schedule].placement, p, v)[-1]
    position = (stage.rank - loss_rank) % p
    transfers.append(Transfer("broadcast", "pp", p, NORM_BYTES, 1,
                              broadcast_sent(NORM_BYTES, p, position), "step", "loss broadcast"))
    # Gradient clipping sums the stages' squared norms (Megatron's clip_grad_norm_fp32
    # over the model-parallel group; minipar all-reduces over TP, then over PP).
    transfers.append(Transfer("all_reduce", "pp", p, NORM_BYTES, 1,
                              all_reduce_sent(1, NORM_BYTES, p, stage.rank), "step",
                              GRADIENT_NORM))
    return transfers


# ------------------------------------------------------------------ context parallel
RING_KV = "ring attention K/V"
RING_DKV = "ring attention dK/dV"


def _context_parallel(shape, config, stage) -> list[Transfer]:
    n, layers = config.cp, stage.layers
    if n == 1 or not layers:
        return []
    nbytes = config.bytes
    b, m = config.micro_batch_size, config.micro_batches
    forward, backward = ring_attention_bytes(b, shape.seq_len, shape.kv_dim, n,
                                             nbytes.activation, config.tp, nbytes.compute)
    kv = forward // (n - 1)
    dkv = backward // (n - 1) - kv
    hops = (n - 1) * layers * m
    transfers = [Transfer("send", "cp", n, kv, hops, kv, "forward", RING_KV),
                 Transfer("send", "cp", n, kv, hops, kv, "backward", RING_KV),
                 Transfer("send", "cp", n, dkv, hops, dkv, "backward", RING_DKV)]
    recomputed = sum(config.recompute.recomputed_layers(c) for c in stage.chunk_layers)
    if recomputed:  # full recomputation runs those layers' ring forward again
        transfers.append(Transfer("send", "cp", n, kv, (n - 1) * recomputed * m, kv,
                                  "backward", RING_KV + " (recomputed)"))
    return transfers


# ------------------------------------------------------------------ expert parallel
DISPATCH, COMBINE = "MoE dispatch all-to-all", "MoE combine all-to-all"


def _expert_parallel(shape, config, stage) -> list[Transfer]:
    """Per MoE layer and micro-batch: dispatch and combine forward, both again backward,
    and the forward's pair once more in backward for each layer full recomputation
    runs again."""
    ep, layers = config.ep, stage_moe_layers(shape, stage)
    if ep == 1 or not layers:
        return []
    a, b, m = config.bytes.activation, config.micro_batch_size, config.micro_batches
    full, sent = buffer_bytes(shape, b, a), all_to_all_sent_per_call(shape, b, ep, a)
    _, again = recomputed_layers(shape, config, stage)
    return [Transfer("all_to_all", "ep", ep, full, count * m, sent, phase, label + suffix)
            for count, phase, suffix in ((layers, "forward", ""), (layers, "backward", ""),
                                         (again, "backward", RECOMPUTED))
            if count for label in (DISPATCH, COMBINE)]


def _merge(transfers: list[Transfer]) -> list[Transfer]:
    """Merge transfers that differ only in count (same op, size and phase)."""
    merged: dict[tuple, Transfer] = {}
    for tr in transfers:
        key = (tr.op, tr.group, tr.nbytes, tr.sent, tr.phase, tr.label)
        if key in merged:
            old = merged[key]
            merged[key] = Transfer(old.op, old.group, old.group_size, old.nbytes,
                                   old.count + tr.count, old.sent, old.phase, old.label)
        else:
            merged[key] = tr
    return list(merged.values())
