"""What backward holds of its own beside the gradient reduction's buffers, and where in
backward's order: the `Held` moments and the `during` spans that gradient_walk.
reduction_buffers adds to the flat copies and pieces it walks.

    sequence parallelism   its (b, s, h) input re-gathered while a column-parallel
                           weight's gradient is formed: the head's, then each layer's
                           MLP-in and QKV (Korthikanti et al. 2022, section 4.2.2;
                           minipar/parallel/tensor/sequence.py)
    ring attention         a received K/V block in forward; in backward a block and a
                           partial sum of the K/V gradients (parallel/context/
                           ring_attention.py), just before QKV's gradient
    a pipeline stage       through its last backward (or W, under a split backward),
                           which reduces its buckets with overlap: the micro-batch's
                           messages and its input gradient (walked_activations.
                           last_backwards for several chunks)

Exact against the emulator's ledger on the grids of benchmarks/gradient_memory.py
(`beside`, `pipelines`, `pipelines-dp`); docs/planner.md names what is left.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate

import numpy as np

from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.plan.context import local_shape
from minipar.plan.gradient_walk import (
    NOTHING_HELD,
    Held,
    backward_order,
    backward_sequence,
    held_at,
    held_together,
    made_before,
)
from minipar.plan.layout import ParallelConfig, StagePlan, checkpointed_by_chunk
from minipar.plan.parameter_order import (
    column_parallel_weights,
    embedding_tensors,
    layer_tensors,
)
from minipar.plan.shapes import ModelShape
from minipar.plan.walked_activations import last_backwards, walkable


def backward_held(shape: ModelShape, config: ParallelConfig, stage: StagePlan,
                  tensors: tuple[int, ...], moe_layers: int = 0
                  ) -> tuple[Held, tuple[tuple[int, int], ...]]:
    """The buffers backward holds of its own while the gradients reduce: where in
    backward's order (gradient_walk.Held), and from where to its end ((place, bytes)).
    Sequence parallelism re-gathers a column-parallel layer's (b, s, h) input for its
    weight gradient (the head's first, then each layer's MLP-in and QKV:
    parallel/tensor/sequence.py). Ring attention's backward, just before QKV's, holds
    its blocks (`ring_attention_buffers`); so does a checkpointed segment's forward, run
    again as the segment's backward starts. A pipeline stage reduces during its last
    backward only with overlap (else after the flush: train/build.py), and then holds
    its messages throughout it (GPipe, 1F1B: every other micro-batch is done by then):
    the received input and output gradient, and the input gradient, sent once backward
    is over: from the first layer's norm on (whose backward hands the input its
    gradient before its own weights theirs), or, when that layer is checkpointed, once
    its segment's backward is over (the checkpoint's backward returns it last). With
    several chunks each chunk's buckets reduce in its own last backward, and the
    computations between hold their own beside them. A split backward's W makes the
    weight gradients, holding only the output gradient (its I sent the input's and ran
    the ring); when every layer is checkpointed its I makes them, walked as an unsplit
    backward, and the W after it the embedding's and the head's (`made_by_last_w`). A
    split backward with only some layers checkpointed, whose Is and Ws both make weight
    gradients, is not walked: none of this is counted here (walked_messages walks the
    messages; the larger of the two is taken)."""
    sp, cp, pp, v = config.sequence_parallel, config.cp, config.pp, config.virtual_stages
    split_schedule = pp > 1 and SCHEDULES[config.schedule].split_backward
    checkpointed = sum(config.recompute.recomputed_layers(n) for n in stage.chunk_layers)
    split = split_schedule and not (stage.layers and checkpointed == stage.layers)
    if pp > 1 and (not config.overlap_grad_reduce or (split and checkpointed)):
        return NOTHING_HELD, ()
    b, t = config.micro_batch_size, config.tp
    message = local_shape(shape, cp).layer_input_bytes(b, t, sp, config.bytes.activation)
    messages = (pp > 1) * ((not stage.last) + (not stage.first and not split))
    sends = pp > 1 and not stage.first and not split and stage.layers  # an input gradient
    regather = regather_bytes(shape, config) if stage.layers or stage.last else 0
    ring = ring_attention_buffers(shape, config) if cp > 1 and stage.layers else (0, 0)
    ring_forward, ring_backward = (0, 0) if split else ring  # (a W runs no attention)
    during = ((0, messages * message),) if messages and v == 1 else ()
    if not (regather or ring_backward or sends or v > 1):
        return NOTHING_HELD, during
    # the last layer of each checkpointed segment, whose forward runs the ring again
    again = tuple(start + end - 1
                  for start, n in zip(accumulate((0, *stage.chunk_layers)),
                                      stage.chunk_layers, strict=False)
                  for _, end, recomputed in config.recompute.segments(n) if recomputed
                  ) if ring_forward else ()
    # each chunk's first layers, when checkpointed: their segment hands its input its
    # gradient once the segment's whole backward is over (the checkpoint's backward
    # returns it), not at the first norm as a plain layer does
    bottoms = tuple(next((end for start, end, redone in config.recompute.segments(n)
                          if start == 0 and redone), 0) for n in stage.chunk_layers)
    moments = (None if moe_layers else
               _column_parallel_moments(shape, t, sp, stage.first, stage.last, tensors,
                                        stage.chunk_layers, again, bottoms))
    if moments is None:
        return NOTHING_HELD, during
    head, qkv, mlp_in, recomputed, starts, inputs = moments
    if head is not None and made_by_last_w(config, stage)[1]:  # in the W, after every I
        head = (len(tensors), sum(tensors))
    held = []
    if v == 1 and sends:
        held.append(_input_gradient_made(inputs[0], bottoms[0], during, message))
        during += ((int(inputs[0][0]), message),)
    elif v > 1:
        # each chunk's buckets reduce during its last backward, beside the messages held
        # then; the computations between two of those hold theirs beside the buckets
        # still in flight (walked_activations.last_backwards; too long to walk, or a
        # chunk of no parameters: not counted here, the larger of the two is taken)
        if not walkable(config.schedule, pp, config.micro_batches, v) or any(
                start is None for start in starts):
            return NOTHING_HELD, ()
        lasts = last_backwards(config.schedule, pp, config.micro_batches, stage.rank, v,
                               message, regather, ring,
                               checkpointed_by_chunk(config, stage) if split_schedule else None)
        previous = 0  # the messages of the chunk before's last backward
        for k, (c, kind, running, between) in enumerate(lasts):
            if k:
                held.append(held_at(starts[c], between, alone=True))
            during += ((int(starts[c][0]), running - previous),)
            previous = running
            if kind != "W" and inputs[c] is not None and SCHEDULES[
                    config.schedule].virtual_stage(pp, stage.rank, c):
                # the input gradient, made at its first norm (or as its checkpointed
                # first segment's backward ends), sent as its backward ends
                held.append(_input_gradient_made(inputs[c], bottoms[c], during, message))
                during += ((int(inputs[c][0]), message),)
                if k + 1 < len(lasts):
                    during += ((int(starts[lasts[k + 1][0]][0]), -message),)
    if head is not None and regather:
        held.append(held_at(head, regather))
    held.append(held_at(qkv, max(regather, ring_backward)))
    if regather:
        held.append(held_at(mlp_in, regather))
    if ring_forward:
        held.append(held_at(recomputed, ring_forward))
    return held_together(*held), during


def _input_gradient_made(place: np.ndarray, bottom: int,
                         during: tuple[tuple[int, int], ...], message: int) -> Held:
    """The moment a checkpointed first segment's input gradient appears, after the
    segment's last weight gradient, maybe past every place of backward: what is held
    then, messages and the gradient, as one moment (nothing for a plain first layer,
    whose input gradient `during` carries from its first norm on)."""
    if not bottom:
        return NOTHING_HELD
    messages = sum(nbytes for start, nbytes in during if start < place[0])
    return held_at(place, messages + message, alone=True)


def made_by_last_w(config: ParallelConfig, stage: StagePlan) -> tuple[bool, bool]:
    """Whether (the embedding's, the head's) gradients are made after every layer's:
    under a split backward whose layers are all checkpointed, the I makes the layers'
    weight gradients (a checkpointed layer's backward runs whole) and the W after it the
    embedding's and the head's. The first stage's last W is its last computation, and so
    is the last stage's under one chunk (ZB-H1, ZB-H2); over two chunks the head's
    gradient is a B's (DualPipe-V), or a W's between the two chunks' last Is (ZB-V),
    which is not modelled: the head is taken first there."""
    if not (config.pp > 1 and stage.layers > 0 and SCHEDULES[config.schedule].split_backward
            and sum(config.recompute.recomputed_layers(n) for n in stage.chunk_layers)
            == stage.layers):
        return False, False
    return stage.first, stage.last and config.virtual_stages == 1


def regather_bytes(shape: ModelShape, config: ParallelConfig) -> int:
    """Bytes of sequence parallelism's extra all-gather in backward (Korthikanti et al.
    2022, section 4.2.2): a column-parallel layer (or the head) re-gathers its full
    (b, s, h) input to form its weight gradient, a buffer while it does (0 without)."""
    if not config.sequence_parallel:
        return 0
    local = local_shape(shape, config.cp)
    return config.micro_batch_size * local.seq_len * local.d_model * config.bytes.activation


def ring_attention_buffers(shape: ModelShape, config: ParallelConfig) -> tuple[int, int]:
    """Bytes ring attention holds as buffers on one rank (parallel/context/
    ring_attention.py): in forward a received K/V block, one at a time (the
    activations' dtype); in backward a block and a partial sum of its gradients on its
    way round the ring (the compute dtype), one after the other over two ranks, together
    over more."""
    local = local_shape(shape, config.cp)
    block = 2 * config.micro_batch_size * local.seq_len * local.kv_dim // config.tp
    forward, partial = block * config.bytes.activation, block * config.bytes.compute
    return forward, (max(forward, partial) if config.cp == 2 else forward + partial)


@lru_cache(maxsize=256)
def _column_parallel_moments(shape: ModelShape, t: int, sequence_parallel: bool,
                             first: bool, last: bool, tensors: tuple[int, ...],
                             chunks: tuple[int, ...], again: tuple[int, ...],
                             bottoms: tuple[int, ...]):
    """(place in backward's order, elements of gradients made before it) of: where the
    head's backward starts (None without a head), where each layer's QKV and MLP-in
    weight gradients are formed, where the backward of each layer of `again` starts (a
    checkpointed segment's last, whose forward runs again then), where each of the
    `chunks` (layers per chunk) starts, and where each chunk's input gradient is made
    (None without layers): as its first norm's weight is, or with `bottoms[c]` of its
    first layers checkpointed, just after their last gradient; in that order; None if a
    layer is listed as one tensor."""
    columns = column_parallel_weights(shape, t)
    if columns is None:
        return None
    layers = sum(chunks)
    front = len(embedding_tensors(shape, t)) if first else 0
    per_layer = len(layer_tensors(shape, t))
    back = len(tensors) - front - layers * per_layer
    order = backward_order(tensors, backward_sequence(shape, 1, t, sequence_parallel, front,
                                                      layers, back))
    qkv, mlp_in = (made_before(order, tuple((front + layer * per_layer + column,)
                                            for layer in range(layers)))
                   for column in columns)
    recomputed = made_before(order, tuple(
        range(front + layer * per_layer, front + (layer + 1) * per_layer) for layer in again))
    # each chunk's layers (the embedding with the first, the head with the last)
    bounds = [0, *accumulate(chunks)]
    groups = [range(front + bounds[c] * per_layer, front + bounds[c + 1] * per_layer)
              for c in range(len(chunks))]
    groups[0] = range(0, groups[0].stop)
    groups[-1] = range(groups[-1].start, len(tensors))
    starts = [made_before(order, (group,))[0] if group else None for group in groups]
    inputs = [None if not chunks[c] else
              made_before(order, ((front + bounds[c] * per_layer,),))[0] if not bottoms[c]
              else _after_last(order, range(front + bounds[c] * per_layer,
                                            front + (bounds[c] + bottoms[c]) * per_layer))
              for c in range(len(chunks))]
    for rows in (qkv, mlp_in, recomputed, *starts, *inputs):
        if rows is not None:
            rows.setflags(write=False)  # cached: shared by every caller
    return ((0, 0) if last else None), qkv, mlp_in, recomputed, starts, inputs


def _after_last(order, group: range) -> np.ndarray:
    """(place just after the last tensor of `group` backward completes, elements made
    by then)."""
    place = int(order.place[group.start:group.stop].max()) + 1
    return np.array((place, order.made[place]), dtype=np.int64)
