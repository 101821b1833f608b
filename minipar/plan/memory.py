"""Predicted memory of one rank, by the ledger's categories.

    params, grads, optimizer   the model state (Rajbhandari et al. 2020, "ZeRO", section
                               3.1 and Figure 1): with mixed precision and Adam,
                               2 + 2 + 12 bytes per parameter; ZeRO-1 divides the 12 by
                               the DP size N, ZeRO-2 also the gradients, ZeRO-3 all 16
    activations                what the layers save for backward (Korthikanti et al. 2022,
                               section 4; see shapes.py), times the micro-batches a
                               pipeline rank keeps in flight (layout.py); with full
                               recomputation only each layer's input plus one layer's
                               working set (their section 5: "2sbhL" + one layer),
                               with selective recomputation no attention probabilities
                               (their 5as^2b) plus one layer's while it recomputes; with
                               Megatron's block / uniform methods, per checkpointed
                               segment its input, per other layer everything
    buffers                    transient: gradient buckets being reduced, ZeRO-3's
                               gathered parameters, received pipeline activations,
                               sequence parallelism's input re-gathered in backward

Parameters per rank are the model's share after TP (Shoeybi et al. 2019's column/row
split, replicated norms; layout in shapes.py) and PP (the rank's layers, the embedding on
the first rank, the head on the last, plus Megatron's copy of a tied embedding on the
last rank when pp > 1).

ZeRO shards flat buffers padded to a multiple of N (DeepSpeed's flat partitions):
stages 1-2 one buffer of the rank's parameters (minipar's `bucket_size_mb` 0; with
buckets the padding of each is ignored, at most N - 1 elements per bucket), stage 3 one
per gather unit (the embedding, each layer, the head), each padded separately. So
ZeRO-1/2 keep the padded flat buffer as their parameters.

Two minipar specifics are modelled because the emulator measures them, each a property
of real frameworks too: the gradient of a recomputed layer's input is a leaf gradient
while that layer's backward runs (torch.utils.checkpoint's reentrant variant), so
checkpointing adds one layer input to "grads" (on top of every parameter gradient with
gradient accumulation; with one micro-batch on top of those backward has made by then,
gradient_walk.py; ZeRO-3 and an offloaded optimizer keep the sum, an upper bound);
and a pipeline rank's received activation is a buffer, so it is not counted again as
the first checkpointed layer's input.

What a real framework counts differently (Megatron-LM's, DeepSpeed's) is
plan/accounting.py's, applied to the ingredients computed here.
This module is long because the peak is one sum of many parts, each checked by the emulator.

Predictions for params, grads and optimizer are exact for minipar's layouts; activations
are exact for one pipeline stage, GPipe and 1F1B, for a rank of several chunks that
save differently, walked over its schedule (walked_activations.py: interleaved and
DualPipe-V), and for the zero-bubble schedules, walked with what a split backward's I
keeps for its W (split_backward.py); the gradient reduction's buffers are exact for
DDP and ZeRO-1/2 on one pipeline stage (gradient_walk.py), beside the backward's own
(sequence parallelism's re-gather, ring attention's blocks: backward_buffers.py), and on a
pipeline stage beside its last backwards' messages too (a split backward with only
some layers checkpointed is taken apart, the larger of the two); so are a pipeline rank's
message buffers, with the re-gather and ring attention's blocks beside them
(walked_activations.py);
buffers and the total are otherwise an estimate:
the total adds the persistent state to the larger of the activation peak and the
gradient-sync peak (gradients count as persistent once gradient accumulation keeps them
across micro-batches, as Megatron's and DeepSpeed's gradient buffers always do).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.plan.accounting import Ingredients, account
from minipar.plan.backward_buffers import (
    backward_held,
    made_by_last_w,
    regather_bytes,
    ring_attention_buffers,
)
from minipar.plan.context import local_shape
from minipar.plan.experts import (
    chunk_moe_layers,
    dense_layer_params,
    expert_layer_params,
    moe_activation_delta,
    stage_moe_layers,
)
from minipar.plan.fp8 import gemm_weights, saved_activation_savings, weight_cache_bytes
from minipar.plan.gradient_walk import (
    Launch,
    backward_sequence,
    bucket_launches,
    grads_peak,
    later_count,
    reduced_pieces,
    reduction_buffers,
)
from minipar.plan.layout import ParallelConfig, StagePlan, checkpointed_by_chunk
from minipar.plan.parameter_order import (
    embedding_late,
    embedding_tensors,
    head_tensors,
    layer_tensors,
    layer_vectors,
)
from minipar.plan.shapes import ModelShape
from minipar.plan.split_backward import input_backward
from minipar.plan.walked_activations import walkable, walked_messages, walked_peak
from minipar.plan.zero3_buffers import backward_peak, gpt_sites

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass(frozen=True)
class StageParameters:
    """Parameter elements one rank of a pipeline stage holds (its TP share).

    units: element counts of ZeRO-3's gather units in forward order (embedding, tied
    copy, layers, head), their sum is `numel`.
    """

    numel: int
    units: tuple[int, ...]
    embedding_unit: int  # elements of the embedding unit (0 if not on this rank)
    tied_unit: int  # elements of the tied copy (last rank, pp > 1)
    expert_numel: int = 0  # of numel, the MoE layers' experts (reduced over dp / ep)
    tensors: tuple[int, ...] = ()  # each parameter's elements, in registration order
    # of `tensors`, which are the (h,) vectors sequence parallelism leaves partial over
    # TP (None: an MoE layer's parameters are listed as one)
    vectors: tuple[bool, ...] | None = None


def flat_buffers(params: StageParameters, config: ParallelConfig) -> list[tuple[int, int]]:
    """(elements, ranks sharing them) of each gradient buffer the data-parallel engines
    reduce: one over DP, or with expert parallelism the non-expert parameters over DP
    and the experts over the expert-data-parallel group (build.expert_data_parallel_engine)."""
    if config.ep == 1 or not params.expert_numel:
        return [(params.numel, config.replicas)]
    return [(params.numel - params.expert_numel, config.replicas),
            (params.expert_numel, config.expert_data_parallel)]


def stage_parameters(shape: ModelShape, config: ParallelConfig,
                     stage: StagePlan) -> StageParameters:
    """The parameters one rank of `stage` holds (its TP share; with experts, its 1/ep)."""
    return _stage_parameters(shape, config.tp, config.ep, stage.first, stage.last,
                             stage.tied_copy, stage.layers, stage_moe_layers(shape, stage))


# A search asks for the same stage's parameters in every layout with this tp and ep, and
# a deep model's tensors are tens of thousands: each stage is laid out once.
@lru_cache(maxsize=64)
def _stage_parameters(shape: ModelShape, t: int, ep: int, first: bool, last: bool,
                      tied_copy: bool, layers: int, moe_layers: int) -> StageParameters:
    layer = sum(shape.layer_params(t))
    expert = expert_layer_params(shape, t, ep) if shape.is_moe else 0
    moe_layer = dense_layer_params(shape, t) + expert if shape.is_moe else 0
    units = []
    embedding = sum(shape.embedding_params(t)) if first else 0
    tied = shape.embedding_params(t)[0] if tied_copy else 0
    if embedding:
        units.append(embedding)
    if tied:
        units.append(tied)
    units += [layer] * (layers - moe_layers) + [moe_layer] * moe_layers
    if last:
        units.append(sum(shape.head_params(t)))
    front = embedding_tensors(shape, t) if embedding else ()
    back = head_tensors(shape, t, tied_copy)[0] if last else (tied,) if tied else ()
    tensors = (front + layer_tensors(shape, t) * (layers - moe_layers)
               + ((moe_layer,) * moe_layers) + back)
    vectors = None
    if not moe_layers and layer_vectors(shape, t) is not None:
        norms = (2 if shape.norm == "layernorm" else 1) if last else 0  # ln_f's, first
        vectors = ((False,) * len(front) + layer_vectors(shape, t) * layers
                   + (True,) * norms + (False,) * (len(back) - norms))
    return StageParameters(numel=sum(units), units=tuple(units), embedding_unit=embedding,
                           tied_unit=tied, expert_numel=moe_layers * expert,
                           tensors=tensors, vectors=vectors)


def shard(numel: int, n: int) -> int:
    """Elements of one rank's piece of a flat buffer of `numel` padded to a multiple of n."""
    return -(-numel // n)


def sharded_numel(params: StageParameters, config: ParallelConfig) -> int:
    """Elements of this rank's ZeRO shard (stages 1-2: its pieces of each engine's
    buckets; 3: per unit)."""
    if config.zero == 3:  # over HSDP's shard group, when it has one; alike units once
        n = config.sharding_group
        return sum(shard(u, n) * count for u, count in Counter(params.units).items())
    return sum(piece for piece, _ in shard_pieces(params, config))


def shard_pieces(params: StageParameters, config: ParallelConfig) -> list[tuple[int, int]]:
    """(my shard's elements, ranks) of each flat buffer ZeRO-1/2 shards. Each gradient
    bucket is padded to a multiple of the ranks on its own (minipar.parallel.data.
    buckets.Bucket), so my shard of a bucketed buffer is the sum of my pieces of its
    buckets; with experts each engine's buffer is taken whole (the experts' tensors are
    not listed apart)."""
    buffers = flat_buffers(params, config)
    if len(buffers) == 1 and config.bucket_size_mb > 0:
        ((_, n),) = buffers
        return [(sum(shard(bucket, n) for bucket in bucket_elements(params, config)), n)]
    return [(shard(numel, n), n) for numel, n in buffers]


def stage_memory(shape: ModelShape, config: ParallelConfig, stage: StagePlan) -> dict:
    """Peak bytes of each category (and `peak_total`) on one rank of pipeline stage
    `stage`. Also returns the parts behind them under "detail"."""
    nbytes = config.bytes
    n, zero = config.replicas, config.zero
    params = stage_parameters(shape, config, stage)
    local = params.numel
    sharded = sharded_numel(params, config)

    if zero == 0:
        param_elements, grad_elements, optimizer_elements = local, local, local
    elif zero in (1, 2):
        padded = sum(piece * ranks for piece, ranks in shard_pieces(params, config))
        param_elements = padded
        grad_elements = local if zero == 1 else sharded
        optimizer_elements = sharded
    else:
        param_elements = grad_elements = optimizer_elements = sharded
        if config.secondary_partition:  # ZeRO++ hpZ, FSDP2's reshard_after_forward=K:
            # every unit's 1/K piece of its padded flat parameters, alive at the end of
            # forward (minipar/parallel/zero/reshard.py)
            n_shard = config.sharding_group
            param_elements += sum(shard(u, n_shard) * n_shard // config.secondary_partition
                                  for u in params.units)

    # Offload (plan/offload.py has the host and NVMe side): the optimizer state leaves
    # the GPU; so does ZeRO-3's parameter shard. ZeRO-2/3's gradient shard is a GPU array
    # only until the accumulation boundary sends it to the host: one bucket's reduced
    # piece at a time with one micro-batch; with accumulation every bucket's running sum
    # plus the piece being added to it (exact for ZeRO-2's buckets; for ZeRO-3 the
    # largest unit's piece, an upper bound within one unit's shard).
    if config.offload_optimizer != "none":
        optimizer_elements = 0
        if zero >= 2:
            pieces = flat_pieces(params, config)
            largest = max(shard(piece, n) for piece in pieces)
            grad_elements = largest + (sharded if config.micro_batches > 1 else 0)
    optimizer_bytes = nbytes.optimizer
    if config.offload_param != "none":
        param_elements = 0
        if config.offload_optimizer == "none" and config.precision != "bf16-mixed":
            optimizer_bytes += nbytes.param  # the optimizer's own copy of my shard

    b, t, sp = config.micro_batch_size, config.tp, config.sequence_parallel
    # activations are of my s/cp tokens (context parallelism); parameters of the model
    layer_input = local_shape(shape, config.cp).layer_input_bytes(b, t, sp,
                                                                  nbytes.activation)
    grads = grad_elements * nbytes.grad
    if zero == 3 and config.hsdp_shard_size and config.replicas > config.sharding_group:
        # HSDP's all-reduce of a unit's gradient shard returns a new array while the old
        # one lives (minipar/parallel/zero/hybrid.py): one more shard, at most the largest
        grads += max(shard(u, config.sharding_group) for u in params.units) * nbytes.grad
    recompute, input_grad = config.recompute, 0
    if recompute.full and stage.layers:
        input_grad = layer_input  # the recomputed layer's input gradient (see above)
    elif recompute.selective and stage.layers:  # the recomputed attention core's input
        input_grad = shape.qkv_bytes(b, t, nbytes.activation)
    if (config.offload_optimizer != "none" and zero == 2
            and not (recompute.full and len(pieces) > 1)):
        # ZeRO-2's reduced piece on its way to the host meets no input gradient: one
        # bucket is reduced after the whole backward, and selective recomputation's input
        # gradient lives only inside the attention core's backward, where no bucket
        # completes. (A recomputed layer's input gradient outlives its buckets' pieces:
        # their sum, an upper bound.)
        grads += max(0, input_grad - largest * nbytes.grad)
    elif input_grad and _one_micro_batch_walkable(config, params):
        grads = _one_micro_batch_grads(shape, config, stage, params, grads, input_grad)
    else:
        grads += input_grad

    activations, forward_buffers, gathered = _activations(shape, config, stage, layer_input)
    # the gradient synchronisation's peak: the DP engines', or after it sequence
    # parallelism's coalesced all-reduce (its flat input and the summed output)
    sync_buffers = _sync_buffers(shape, config, params, stage,
                                 2 * sequence_parallel_gradient_elements(shape, config, stage))
    params_bytes = param_elements * nbytes.param
    if config.fp8_format is not None and not config.fp8_param_gather:
        # TE's cached FP8 weights and transposes beside the bf16 ones (plan/fp8.py)
        params_bytes += weight_cache_bytes(stage.layers * gemm_weights(shape, t))
    paper = Ingredients(params=params_bytes, grads=grads,
                        optimizer=optimizer_elements * optimizer_bytes,
                        activations=activations, forward_buffers=forward_buffers,
                        sync_buffers=sync_buffers, gathered=gathered)
    # what the system that runs the job counts differently (plan/accounting.py)
    parts, terms = account(shape, config, stage, paper, local, sharded)
    state = parts.params + parts.optimizer
    forward_peak = parts.activations + parts.forward_buffers
    if config.offload_optimizer != "none" and zero >= 2:
        # the GPU keeps only the running sums between micro-batches; the piece being
        # added and sent to the host is transient, after the synchronisation's peak
        persistent = sharded * nbytes.grad if config.micro_batches > 1 else 0
        total = state + persistent + max(forward_peak, parts.sync_buffers)
    elif config.micro_batches == 1:
        # zero_grad frees the gradients after each step (set_to_none; every stage,
        # ZeRO-2/3's shard too, as DeepSpeed frees its partitioned gradients), so with
        # one micro-batch they are born in backward as the activations die: the peak is
        # the larger of the forward's end and the gradient synchronisation.
        total = state + max(forward_peak, parts.grads + parts.sync_buffers)
    else:  # the gradients stay from the first micro-batch's backward to the step
        total = state + parts.grads + max(forward_peak, parts.sync_buffers)
    return {
        "params": parts.params,
        "grads": parts.grads,
        "optimizer": parts.optimizer,
        "activations": parts.activations,
        "buffers": max(parts.forward_buffers, parts.sync_buffers),
        "peak_total": total,
        "detail": {"parameters": local, "expert_parameters": params.expert_numel,
                   "shard": sharded, "layer_input": layer_input,
                   "forward_buffers": parts.forward_buffers,
                   "sync_buffers": parts.sync_buffers, "accounting": terms},
    }


def _activations(shape: ModelShape, config: ParallelConfig, stage: StagePlan,
                 layer_input: int) -> tuple[int, int, int]:
    """(activation bytes, buffers held alongside them, of those ZeRO-3's gathered
    parameters) of one rank at its forward peak."""
    nbytes = config.bytes
    b, t, sp = config.micro_batch_size, config.tp, config.sequence_parallel
    a, c = nbytes.activation, nbytes.compute
    full, shape = shape, local_shape(shape, config.cp)  # my s/cp tokens of each sequence
    # ring attention keeps, like FlashAttention, only the log-sum-exp per query
    flash = config.flash_attention or config.cp > 1
    layer = shape.layer_activation_bytes(b, t, sp, a, c, flash)
    if config.fp8_format is not None:  # TE saves FP8 inputs (plan/fp8.py)
        layer -= saved_activation_savings(shape, b, t, sp, a)
    embedding = shape.embedding_activation_bytes(b, t) if stage.first else 0
    head = shape.head_activation_bytes(b, t, sp, a, c) if stage.last else 0
    v, k = config.virtual_stages, stage.in_flight
    # Of the k chunk micro-batches in flight, those of the first virtual stage hold the
    # embedding's ids; every other one arrived from the previous stage as a buffer.
    per_chunk = math.ceil(k / v)
    with_embedding = per_chunk if stage.first else 0
    received = k - with_embedding
    # Micro-batches of head activations: the schedule's in-flight count on the last
    # virtual stage (1F1B runs each backward right after its forward there, so one head;
    # GPipe, or interleaving with m = p, runs every forward first).
    with_head = (SCHEDULES[config.schedule].head_in_flight(config.pp, config.micro_batches, v)
                 if stage.last else 0)
    # Each micro-batch in flight holds what its chunk saved (`_chunk_recompute`); the one
    # whose backward runs may hold more while it recomputes (a checkpointed segment's
    # working set, or one attention core's probabilities). On the last rank, with heads
    # in flight, that backward is the head chunk's: the loss's gradient starts there.
    recompute = config.recompute
    head_first = stage.last and with_head > 0
    saved, extra = 0, 0
    held, working = [], []  # per chunk, for a walk of the schedule (below)
    walk = walkable(config.schedule, config.pp, config.micro_batches, v)
    # (pp = 1 trains one model, no pipeline: its backward is never split)
    split = config.pp > 1 and SCHEDULES[config.schedule].split_backward
    kept, input_working = [], []  # a split backward's, per chunk (split_backward.py)
    moe_layers = chunk_moe_layers(shape, stage)
    moe = moe_activation_delta(shape, b, t, sp, a) if any(moe_layers) else 0
    for c, n in enumerate(stage.chunk_layers):
        holds_head = stage.last and c == v - 1
        # where the chunk's MoE layers sit (their layers hold `moe` more)
        start = stage.chunk_starts[c] if moe else None
        chunk_saved, chunk_extra = _chunk_recompute(shape, config, n, layer, layer_input,
                                                    head if holds_head else 0, start, moe)
        if not recompute.full and moe:  # selective recomputation leaves the MLP's saved
            chunk_saved += moe_layers[c] * moe
        saved += chunk_saved
        if holds_head or not head_first:
            extra = chunk_extra if head_first else max(extra, chunk_extra)
        # one micro-batch of this chunk until its backward: its input is the embedding's
        # output on virtual stage 0, else a buffer (received, or handed over by a V's tip)
        embeds = stage.first and c == 0
        buffered = layer_input if recompute.full and n and not embeds else 0
        held.append(chunk_saved + (embedding if embeds else 0) + (head if holds_head else 0)
                    - buffered)
        working.append(chunk_extra)
        if split:
            first = stage.chunk_starts[c]
            freed, during = input_backward(shape, config, range(first, first + n), layer,
                                           head=holds_head, embeds=embeds, moe=moe)
            kept.append(held[-1] + freed)
            input_working.append(during)
    if walk and (split or (v > 1 and (len(set(held)) > 1 or len(set(working)) > 1))):
        # Chunks that save differently (more layers, MoE layers, the embedding or the
        # head), or a split backward's I and W: which micro-batches are in flight at
        # the peak, what each holds then, and whose backward runs, is the schedule's
        # order, walked (walked_activations.py). Chunks that save alike under an unsplit
        # backward keep the closed form, exact for them; so does a pipeline too long to
        # walk.
        activations = walked_peak(config.schedule, config.pp, config.micro_batches,
                                  stage.rank, held, working, kept or None,
                                  input_working or None)
    elif split:  # too long to walk: an upper bound, each of the k micro-batches in
        # flight holding the most any chunk holds before its I or after it (an I can
        # keep more than its forward saved: sequence parallelism's gathered gradients),
        # and the largest working set on top
        activations = (k * max(max(held), max(kept))
                       + max(max(working), max(input_working)))
    else:
        activations = (k * saved // v + with_embedding * embedding + with_head * head
                       + extra)
        if recompute.full and stage.layers:
            activations -= received * layer_input  # a received input is already a buffer
    # sequence parallelism's re-gather, in a B or a split backward's W
    inside = regather_bytes(full, config) if stage.layers or stage.last else 0
    # Received activations wait for their backward as buffers; during a backward a
    # received output gradient, and at its end the input gradient being sent back, are
    # buffers too: k in flight and one of each on one chunk under an unsplit backward
    # (GPipe, 1F1B), else walked over the schedule (walked_activations.py; a split
    # backward's I makes a checkpointed layer's weight gradients, and so re-gathers for
    # them, and frees the output gradient when the chunk's last layer is one)
    # Ring attention's blocks: a forward's, and more in a backward (or a split
    # backward's I), which runs the attention core's; never beside the re-gather.
    ring = (ring_attention_buffers(full, config) if config.cp > 1 and stage.layers
            else (0, 0))
    if walk and config.pp > 1 and (split or v > 1):
        forward_buffers = walked_messages(config.schedule, config.pp, config.micro_batches,
                                          stage.rank, v, checkpointed_by_chunk(config, stage),
                                          layer_input, inside, ring)
    else:  # (a forward holds no output gradient, and a block at most the backward's)
        piped = config.pp > 1
        forward_buffers = ((received + (not stage.last) * piped) * layer_input
                           + max((not stage.first) * piped * layer_input, inside, ring[1]))
    gathered = 0
    if config.zero == 3:
        # gathered full parameters of the running unit (and of a tied embedding the head
        # uses), held while the unit computes
        params = stage_parameters(full, config, stage)
        largest = max(params.units) if params.units else 0
        # with prefetch, the next unit's all-gather is in flight meanwhile: at most one
        # more unit (bounded by the largest); an offloaded shard is not prefetched
        # (minipar/parallel/zero/stage3.py) but fetched to the GPU to be gathered
        offloaded = config.offload_param != "none"
        in_flight = 2 if config.zero3_prefetch and not offloaded else 1
        held = in_flight * largest
        if config.reshard_after_forward is False:  # FSDP2: every unit stays gathered from
            held = max(held, sum(params.units))  # its forward to its backward
        gathered = held * nbytes.param
        if offloaded:
            gathered += shard(largest, config.dp) * nbytes.param
        forward_buffers += gathered
    return activations, forward_buffers, gathered


def _chunk_recompute(shape: ModelShape, config: ParallelConfig, n_layers: int, layer: int,
                     layer_input: int, head: int, start: int | None = None,
                     moe: int = 0) -> tuple[int, int]:
    """(bytes one micro-batch of a chunk of n_layers saves for backward, the most its
    backward adds on top of that while recomputing), head excluded from the first.

    Backward frees the head, then the layers from the last one down. A checkpointed
    segment (full) holds the inputs of the segments before it and its own layers'
    working set; a selective layer holds the layers below it, what its attention branch
    keeps (`attention_branch_bytes`) and the recomputed probabilities. start: the
    model's index of the chunk's first layer, whose MoE layers hold `moe` bytes more
    (full recomputation; None: none counted here).
    """
    recompute = config.recompute
    b, t, sp = config.micro_batch_size, config.tp, config.sequence_parallel
    a, c = config.bytes.activation, config.bytes.compute
    if n_layers == 0 or recompute.granularity is None:
        return n_layers * layer, 0
    if recompute.selective:
        core = shape.attention_core_bytes(b, t, a, c, config.flash_attention)
        selective = layer - core
        branch = shape.attention_branch_bytes(b, t, sp, a, c)
        at_core = (n_layers - 1) * selective + branch + core
        return n_layers * selective, max(0, at_core - n_layers * selective - head)
    saved, peak, inputs = 0, 0, 0
    for first, end, checkpointed in recompute.segments(n_layers):
        held = (end - first) * layer
        if start is not None:
            held += moe * shape.moe_layers_in(start + first, start + end)
        if checkpointed:
            inputs += 1
            saved += layer_input
            peak = max(peak, inputs * layer_input + held)
        else:
            saved += held
    return saved, max(0, peak - saved - head)


def _one_micro_batch_walkable(config: ParallelConfig, params: StageParameters) -> bool:
    """Whether gradient_walk.py knows the order backward makes this rank's gradients
    in: one micro-batch, one chunk, ZeRO-0 to 2 with the optimizer on the GPU, and under
    ZeRO-2 no experts (their tensors are not listed one by one)."""
    return (config.micro_batches == 1 and config.virtual_stages == 1 and config.zero <= 2
            and config.offload_optimizer == "none"
            and not (config.zero == 2 and params.expert_numel))


def _one_micro_batch_grads(shape: ModelShape, config: ParallelConfig, stage: StagePlan,
                           params: StageParameters, final: int, input_grad: int) -> int:
    """The "grads" peak of one micro-batch's backward under recomputation
    (gradient_walk.py); final: the bytes the step ends with."""
    recompute = config.recompute
    first = 0 if recompute.selective else next(
        start for start, _, checkpointed in recompute.segments(stage.layers) if checkpointed)
    front = len(embedding_tensors(shape, config.tp)) if stage.first else 0
    later = later_count(shape, config.tp, front, first, recompute.selective)
    if later is None or (params.expert_numel and (recompute.selective or first)):
        return final + input_grad  # (an MoE layer is one tensor: memory.StageParameters)
    if config.zero < 2:  # the later ones are the first `later` in registration order
        made = sum(params.tensors[later:])
    else:
        # (the input gradient's place in the backward sequence: the later ones end it)
        made = reduced_pieces(_launches(shape, config, stage), len(params.tensors) - later,
                              config.replicas, config.reductions_in_flight,
                              config.overlap_grad_reduce)
    return grads_peak(final, input_grad, config.bytes.grad, made)


def _launches(shape: ModelShape, config: ParallelConfig, stage: StagePlan
              ) -> tuple[Launch, ...]:
    """This rank's gradient buckets as backward launches them (gradient_walk.py)."""
    return _stage_launches(shape, config.tp, config.ep, config.sequence_parallel,
                           stage.first, stage.last, stage.tied_copy, stage.layers,
                           stage_moe_layers(shape, stage),
                           config.bucket_size_mb * 2**20, config.bytes.param, config.pp,
                           *made_by_last_w(config, stage))


# A search plans the same stage under many DP sizes and micro-batches: its buckets are
# launched alike (backward's order does not depend on the micro-batch: every op's FLOPs
# grow with its tokens).
@lru_cache(maxsize=256)
def _stage_launches(shape: ModelShape, t: int, ep: int, sequence_parallel: bool,
                    first: bool, last: bool, tied_copy: bool, layers: int, moe_layers: int,
                    cap: float, itemsize: int, pp: int, embedding_after: bool = False,
                    head_after: bool = False) -> tuple[Launch, ...]:
    params = _stage_parameters(shape, t, ep, first, last, tied_copy, layers, moe_layers)
    tensors = params.tensors
    buckets = (_bucket_tensors(tensors, cap, itemsize) if cap > 0
               else (tuple(reversed(range(len(tensors)))),))
    front = len(embedding_tensors(shape, t)) if first else 0
    back = len(tensors) - front - layers * len(layer_tensors(shape, t))
    sequence = backward_sequence(shape, 1, t, sequence_parallel, front, layers, back)
    # what is reduced after the flush (a pipeline's tied wte, the first stage's and the
    # last's copy): its bucket is deferred (minipar/train/build.py); so is an embedding or
    # a head whose gradients are made after the layers' (backward_buffers.made_by_last_w)
    late = (((True,) * front if embedding_after else
             embedding_late(shape, t, pp) if first else ())
            + (False,) * (len(tensors) - front - back)
            + ((True,) * back if head_after else
               head_tensors(shape, t, tied_copy)[1] if last else (False,) * back))
    return bucket_launches(tensors, buckets, sequence,
                           frozenset(i for i, deferred in enumerate(late) if deferred))


def flat_pieces(params: StageParameters, config: ParallelConfig) -> tuple[int, ...]:
    """Elements of each flat buffer a ZeRO rank shards, and an offloading one sends to the
    host piece by piece: one per ZeRO-3 unit, one per gradient bucket under ZeRO-1/2
    (each padded and sharded on its own), or with one bucket the whole."""
    if config.zero == 3:
        return params.units
    if config.bucket_size_mb > 0:
        return tuple(bucket_elements(params, config))
    return (params.numel,)


def bucket_elements(params: StageParameters, config: ParallelConfig) -> list[int]:
    """Elements of each gradient bucket of a rank, in the order backward fills them
    (minipar.parallel.data.buckets.build_buckets: reverse registration order, at most
    bucket_size_mb of parameters, a larger tensor alone)."""
    return list(_bucket_elements(params.tensors, config.bucket_size_mb * 2**20,
                                 config.bytes.param))


@lru_cache(maxsize=64)
def _bucket_elements(tensors: tuple[int, ...], cap: float, itemsize: int) -> tuple[int, ...]:
    return tuple(sum(tensors[i] for i in bucket)
                 for bucket in _bucket_tensors(tensors, cap, itemsize))


@lru_cache(maxsize=64)  # every layout of a search with these stage's tensors: once
def _bucket_tensors(tensors: tuple[int, ...], cap: float, itemsize: int
                    ) -> tuple[tuple[int, ...], ...]:
    """Which of `tensors` each bucket holds, in the order it lays them end to end."""
    buckets, size = [[]], 0
    for i in reversed(range(len(tensors))):
        if buckets[-1] and size + tensors[i] * itemsize > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += tensors[i] * itemsize
    return tuple(map(tuple, buckets))


def sequence_parallel_vectors(shape: ModelShape, stage: StagePlan) -> int:
    """The (h,) parameters of one rank whose gradients sequence parallelism leaves partial
    over TP: each layer's norm weights (and biases) and row-parallel biases, and ln_f's
    on the last stage (an MoE layer's experts keep their row-parallel biases whole)."""
    norms = 2 * (2 if shape.norm == "layernorm" else 1)
    small = norms + (2 if shape.bias else 0)
    return (small * stage.layers - (stage_moe_layers(shape, stage) if shape.bias else 0)
            + (norms // 2 if stage.last else 0))


def sequence_parallel_gradient_elements(shape: ModelShape, config: ParallelConfig,
                                        stage: StagePlan) -> int:
    """Elements of the flat buffer sequence parallelism all-reduces over TP once per step
    (minipar/parallel/tensor/sequence_grads.py; Megatron's finalize_model_grads): the
    vectors' gradients the optimizer reads; under ZeRO the parts of them in my shard of
    each flat buffer (`first_shard_vectors`; about 1/N of them on an MoE stage, whose
    layers' tensors are not listed); 0 without it, or with an offloaded optimizer (f
    all-reduces each in backward)."""
    if not config.sequence_parallel or config.tp == 1 or config.offload_optimizer != "none":
        return 0
    elements = sequence_parallel_vectors(shape, stage) * shape.d_model
    if config.zero and config.replicas > 1:
        params = stage_parameters(shape, config, stage)
        if params.vectors is None:
            return shard(elements, config.replicas)
        return first_shard_vectors(shape, config, stage, params)
    return elements


def first_shard_vectors(shape: ModelShape, config: ParallelConfig, stage: StagePlan,
                        params: StageParameters) -> int:
    """Elements of the sequence-parallel vectors in the first ZeRO shard of each flat
    buffer, the rank at dp 0's (the planner's rank): each buffer is padded to a multiple
    of its N ranks and cut in N equal pieces (minipar.parallel.data.buckets.Bucket).
    ZeRO-1/2 lay a bucket's tensors in reverse registration order (build_buckets), ZeRO-3
    a unit's in registration order (stage3.gpt_units: the embedding's, each layer's, the
    head's ln_f then an untied LM head, a tied copy apart)."""
    h = shape.d_model
    if config.zero == 3:
        n = config.sharding_group
        layer = layer_tensors(shape, config.tp)
        in_layer = _vectors_within(zip(layer, layer_vectors(shape, config.tp), strict=True),
                                   shard(sum(layer), n))
        head = 0
        if stage.last:  # the head's unit, the last: ln_f first, then an untied LM head
            norms = (2 if shape.norm == "layernorm" else 1) * h
            head = min(norms, shard(params.units[-1], n))
        return stage.layers * in_layer + head
    cap = config.bucket_size_mb * 2**20 if config.bucket_size_mb > 0 else 0.0
    return _buckets_first_shard_vectors(params.tensors, params.vectors, cap,
                                        config.bytes.param, config.replicas)


@lru_cache(maxsize=64)  # a search meets the same stage in many layouts
def _buckets_first_shard_vectors(tensors: tuple[int, ...], vectors: tuple[bool, ...],
                                 cap: float, itemsize: int, n: int) -> int:
    """first_shard_vectors over ZeRO-1/2's buckets of at most `cap` bytes (0: one)."""
    if cap > 0:
        buckets = _bucket_tensors(tensors, cap, itemsize)
        totals = _bucket_elements(tensors, cap, itemsize)
    else:
        buckets, totals = (range(len(tensors) - 1, -1, -1),), (sum(tensors),)
    return sum(_vectors_within(((tensors[i], vectors[i]) for i in bucket), shard(total, n))
               for bucket, total in zip(buckets, totals, strict=True))


def _vectors_within(tensors, stop: int) -> int:
    """Elements of the vectors among (elements, vector?) tensors laid end to end that
    fall in the first `stop` elements."""
    total, at = 0, 0
    for numel, vector in tensors:
        if at >= stop:
            break
        if vector:
            total += min(numel, stop - at)
        at += numel
    return total


def _sync_buffers(shape: ModelShape, config: ParallelConfig, params: StageParameters,
                  stage: StagePlan, after: int) -> int:
    """Peak transient bytes of gradient synchronisation over the DP group, and after it
    of sequence parallelism's coalesced all-reduce (`after` elements: its flat input and
    the summed output), beside ZeRO-1's reduced pieces.

    ZeRO-0 to 2: the buckets walked as backward launches them (gradient_walk.py): the
    flat copies in flight and what their reductions return, ZeRO-2's gradients until
    flattened; with experts or an offloaded optimizer an estimate (one flat buffer, or
    ZeRO-2's bucket and its neighbour in flight). ZeRO-3: unit by unit
    (zero3_buffers.py), the gathered parameters, one unit's gradients and at most two
    flat copies in flight. With expert parallelism the two engines synchronise one after
    the other: the larger one's peak.
    """
    nbytes = config.bytes
    g = nbytes.grad
    buffers = flat_buffers(params, config)
    if config.zero == 1 and len(buffers) == 2:
        # both engines' reduce-scatters are launched by the last backward's hooks; the
        # dense one is waited for first (its piece arrives while the experts' flat
        # gradient is in flight), then the experts' while the dense piece waits for the
        # step (ExpertDataParallel's order)
        (dense, n), (experts, edp) = buffers
        return max(max(dense, shard(experts, edp)) + shard(dense, n) + experts, after) * g
    if config.zero in (0, 1, 2):
        peaks = [after * g]
        for numel, n in buffers:
            # (DDP over one rank reduces nothing; ZeRO's engines reduce over one too)
            if (config.zero > 0 or n > 1) and not params.expert_numel and (
                    config.offload_optimizer == "none"):
                # DeepSpeed's reduce buckets, DDP's and minipar's: walked in the order
                # backward launches them (gradient_walk.py)
                in_flight = None if config.zero == 0 else config.reductions_in_flight
                peaks.append(reduction_buffers(
                    _launches(shape, config, stage), len(params.tensors), config.zero, n,
                    in_flight, config.overlap_grad_reduce, config.micro_batches > 1, g,
                    nbytes.param, after, *backward_held(shape, config, stage, params.tensors,
                                                        stage_moe_layers(shape, stage))))
            elif config.zero == 0 and n > 1:
                bucket = (config.bucket_size_mb * 2**20 / g if config.bucket_size_mb > 0
                          else numel)
                peaks.append(int(numel * g + min(bucket, numel) * g))
            elif config.zero == 1:
                peaks.append(numel * g + shard(numel, n) * g)
            elif config.zero == 2 and len(buffers) == 1 and config.bucket_size_mb > 0:
                # an offloaded optimizer's pieces leave for the host (offload.py), or
                # experts, whose layers are listed as one tensor: bucket i's gradients,
                # their flat copy and the previous bucket's still in flight, an estimate
                sizes = [0, *bucket_elements(params, config)]
                peaks.append(max(2 * b + a for a, b in zip(sizes[:-1], sizes[1:],
                                                            strict=True)) * g)
            elif config.zero == 2:
                peaks.append(2 * numel * g)
        return max(peaks)
    # An offloaded parameter shard is fetched by the gather itself, not prefetched; an
    # offloaded optimizer books the reduced piece as a gradient on its way to the host.
    sites = gpt_sites(len(params.units), bool(params.embedding_unit), stage.last,
                      shape.tie_embeddings)
    return max(after * g, backward_peak(
        params.units, sites, config.sharding_group, nbytes.param, g,
        prefetch=config.zero3_prefetch and config.offload_param == "none",
        overlap=config.overlap_grad_reduce,
        accumulate=config.micro_batches > 1 and config.offload_optimizer == "none",
        kept=config.reshard_after_forward is False))
