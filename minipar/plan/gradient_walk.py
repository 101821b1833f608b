"""One backward's gradients, tensor by tensor: the "grads" peak of a step of one
micro-batch under recomputation, and ZeRO-2's bucket buffers.

Backward completes a rank's parameter gradients in a fixed order (`backward_sequence`):
the head, the layers from the last, the embedding (wpe before wte); inside a module by
its share of the module's backward (parameter_order.layer_ready / head_ready), ties (a
norm's weight and bias, one op) in registration order, as the op hands out its
gradients. A gradient
bucket is launched when its last tensor is complete (`bucket_launches`).

Recomputation. A recomputed layer's input gradient is a leaf gradient while its
backward runs (torch.utils.checkpoint's reentrant variant; selective recomputation's
attention core likewise for its q, k, v), so it counts under "grads" beside the
parameters' gradients. With several micro-batches every parameter gradient exists from
the first backward on, and the peak is all of them plus that input gradient. With one,
backward meets the lowest recomputed layer of the stage (where the input gradient is
last alive) while some parameter gradients are still to come: those of the layers below
it (for selective recomputation, its own norm and QKV, whose backward follows the
attention core's) and the embedding's, a tied wte's too (the engine sums a leaf's
contributions, the head's among them, before its gradient exists: minipar.autograd.
engine). Those are the end of the sequence (`later_count`). So

    peak = max(what the step ends with,  what exists at that moment + the input gradient)

What exists is the parameter gradients made so far under ZeRO-0/1 (they stay until the
step). Under ZeRO-2 "grads" holds the rank's reduced pieces: those of the buckets
launched by then, less the last `in_flight` of them when reductions overlap backward
(DeepSpeed's overlap_comm: the oldest is waited for, and its piece kept, only when a
further one starts; minipar.parallel.zero.sharded).

Reduction buffers (`reduction_buffers`). Each bucket is flattened when complete (the
flat copy, padded to a multiple of the ranks under ZeRO, is made before ZeRO-2 frees the
gradients, which are buffers there until then) and its reduction launched; the flat
copy lives until the reduction is waited for, at once or, overlapping backward, when a
further one would exceed the limit in flight, or at the end of backward
(minipar.parallel.data.ddp, minipar.parallel.zero.sharded). The peak comes as a bucket's
last gradient is made, as it is flattened, or as a reduction returns; or where backward
holds buffers of its own beside them (`Held`): sequence parallelism's re-gathered input
while a column-parallel weight's gradient is formed (Korthikanti et al. 2022, section
4.2.2), ring attention's blocks while the attention core's backward runs.

Shapes: `tensors` are the elements of each parameter of one rank (TP share), in
registration order (memory.StageParameters); buckets are tuples of their indices
(memory._bucket_tensors: one per bucket, in the order backward fills it).
"""

from __future__ import annotations

from itertools import accumulate, chain
from typing import NamedTuple

import numpy as np

from minipar.plan.parameter_order import head_ready, layer_ready, layer_tensors
from minipar.plan.shapes import ModelShape


def backward_sequence(shape: ModelShape, b: int, tp: int, sequence_parallel: bool,
                      front: int, layers: int, back: int) -> tuple[int, ...]:
    """Indices of a stage's front (embedding) + layers + back (head) tensors, listed in
    registration order, in the order backward completes their gradients."""
    ready = layer_ready(shape, b, tp, sequence_parallel)
    inner = sorted(range(len(ready)), key=lambda j: (ready[j], j))
    head = head_ready(shape, b, tp, (0,) * back) if back else ()
    start = front + layers * len(ready)
    sequence = [start + j for j in sorted(range(back), key=lambda j: (head[j], j))]
    for layer in reversed(range(layers)):
        start = front + layer * len(ready)
        sequence += [start + j for j in inner]
    # the embedding: its norm's weight and bias (BLOOM's, one op), then the positions'
    # table before the tokens' (the sum's backward hands the positions theirs first)
    tables = min(front, 2 if shape.position == "learned" else 1)
    return (*sequence, *range(tables, front), *reversed(range(tables)))


def later_count(shape: ModelShape, tp: int, front: int, first_recomputed: int,
                selective: bool) -> int | None:
    """How many tensors get their gradients only after the lowest recomputed layer's
    input gradient is gone: the embedding's, the layers' below it, under selective
    recomputation its own norm and QKV. They end `backward_sequence` and are the first
    in registration order. None if a layer's tensors are not listed one by one."""
    per_layer = layer_tensors(shape, tp)
    if len(per_layer) == 1 and (selective or first_recomputed):
        return None
    later = front + first_recomputed * len(per_layer)
    if selective:  # the first norms and the QKV weight and bias: layer_tensors' order
        later += (2 if shape.norm == "layernorm" else 1) + (2 if shape.bias else 1)
    return later


class Launch(NamedTuple):
    """A bucket as backward launches it: its elements, the elements of every gradient
    made by then (its own included) and its last tensor's place in the sequence."""

    numel: int
    made: int
    position: int


def bucket_launches(tensors: tuple[int, ...], buckets: tuple[tuple[int, ...], ...],
                    sequence: tuple[int, ...], deferred: frozenset[int] = frozenset()
                    ) -> tuple[Launch, ...]:
    """The buckets in the order backward completes them; those holding a `deferred`
    tensor (a pipeline's tied wte, final only once its copies are summed) after the
    whole backward, in the order they were built (DataParallel.defer_reduction)."""
    place = [0] * len(tensors)
    for position, i in enumerate(sequence):
        place[i] = position
    made = list(accumulate(tensors[i] for i in sequence))
    end = len(sequence) - 1  # (every gradient is made by then)
    lasts = sorted((end + 1 if deferred.intersection(bucket) else
                    max(place[i] for i in bucket), k) for k, bucket in enumerate(buckets)
                   if bucket)  # (a rank of no parameters has one empty bucket)
    return tuple(Launch(sum(tensors[i] for i in buckets[k]), made[min(last, end)], last)
                 for last, k in lasts)


class Held(NamedTuple):
    """Bytes backward holds as buffers of its own, one entry per moment (arrays of one
    length, in backward's order): just before the tensor at sequence place `position`
    is complete, when `made` elements of gradients exist, it holds `nbytes`; `alone`:
    held by a computation that runs between two chunks' last backwards (in place of
    what those hold throughout). Arrays, not a tuple per moment: a 4,096-layer stage
    has tens of thousands, and a search walks them for every layout it plans."""

    position: np.ndarray
    made: np.ndarray
    nbytes: np.ndarray
    alone: np.ndarray


def held_at(moments: np.ndarray, nbytes: int, alone: bool = False) -> Held:
    """`nbytes` held at each (place, made) row of `moments` (made_before's rows)."""
    moments = np.asarray(moments, dtype=np.int64).reshape(-1, 2)
    count = len(moments)
    return Held(moments[:, 0], moments[:, 1], np.full(count, nbytes, dtype=np.int64),
                np.full(count, alone))


def held_together(*parts: Held) -> Held:
    """The moments of every part, in backward's order."""
    joined = [np.concatenate(column) for column in zip(*parts, strict=True)] if parts else (
        [np.zeros(0, dtype=np.int64)] * 3 + [np.zeros(0, dtype=bool)])
    order = np.argsort(joined[0], kind="stable")
    return Held(*(column[order] for column in joined))


NOTHING_HELD = held_together()


class BackwardOrder(NamedTuple):
    """Where each tensor's gradient is made in backward's order (`place`, by registration
    index), and the elements of the gradients made before each place (`made`, one more
    entry: every gradient)."""

    place: np.ndarray
    made: np.ndarray


def backward_order(tensors: tuple[int, ...], sequence: tuple[int, ...]) -> BackwardOrder:
    """The BackwardOrder of a stage's `tensors` (elements, registration order) completed
    in `sequence` (backward_sequence)."""
    place = np.empty(len(sequence), dtype=np.int64)
    place[np.asarray(sequence, dtype=np.int64)] = np.arange(len(sequence))
    made = np.zeros(len(sequence) + 1, dtype=np.int64)
    np.cumsum(np.asarray(tensors, dtype=np.int64)[list(sequence)], out=made[1:])
    return BackwardOrder(place, made)


def made_before(order: BackwardOrder, groups: tuple[tuple[int, ...] | range, ...]
                ) -> np.ndarray:
    """Rows (place in backward's order, elements of the gradients made before it) of the
    first tensor backward completes of each group of `groups` (indices in registration
    order, none empty), in backward's order."""
    if not groups:
        return np.zeros((0, 2), dtype=np.int64)
    if all(isinstance(group, range) and group.step == 1 for group in groups):
        firsts = np.array([order.place[group.start:group.stop].min() for group in groups],
                          dtype=np.int64)
    else:
        sizes = [len(group) for group in groups]
        members = np.fromiter(chain.from_iterable(groups), dtype=np.int64,
                              count=sum(sizes))
        starts = np.concatenate(([0], np.cumsum(sizes[:-1]))).astype(np.int64)
        firsts = np.minimum.reduceat(order.place[members], starts)
    firsts = np.sort(firsts)
    return np.stack((firsts, order.made[firsts]), axis=1)


def grads_peak(final: int, input_grad: int, grad_bytes: int, made: int) -> int:
    """Peak "grads" bytes (module docstring): `made` elements of gradients (ZeRO-0/1)
    or of reduced pieces (ZeRO-2: `reduced_pieces`) exist beside the input gradient."""
    return max(final, made * grad_bytes + input_grad)


def reduced_pieces(launches: tuple[Launch, ...], before: int, ranks: int,
                   in_flight: int | None, overlap: bool) -> int:
    """Elements of a ZeRO-2 rank's pieces of the buckets launched before sequence place
    `before` and waited for: all of them without overlap; under overlap all but the
    last `in_flight` (None: no limit, so none is waited for before backward ends)."""
    launched = [launch for launch in launches if launch.position < before]
    if overlap:
        waited = 0 if in_flight is None else max(0, len(launched) - in_flight)
        launched = launched[:waited]
    return sum(-(-launch.numel // ranks) for launch in launched)


def reduction_buffers(launches: tuple[Launch, ...], length: int, zero: int, ranks: int,
                      in_flight: int | None, overlap: bool, accumulate_pieces: bool,
                      grad_bytes: int, param_bytes: int, after: int = 0,
                      backward_held: Held | None = None,
                      during: tuple[tuple[int, int], ...] = ()) -> int:
    """Peak bytes of the "buffers" a data-parallel engine's bucketed reduction holds
    in one backward and the step after it (module docstring), ZeRO stage `zero` over
    `ranks`: the gradients made whose bucket is not flattened yet (ZeRO-2, whose full
    gradients are buffers), each flat copy until its reduction is waited for, and what
    the wait returns: DDP's averaged copy while it is written back, ZeRO-1's reduced
    piece, kept until the step (whose all-gather then holds a bucket's parameters), a
    later micro-batch's piece under ZeRO-2 while it is added into the shard
    (`accumulate_pieces`). `in_flight`: reductions outstanding at most under overlap
    (None: no limit; DDP has none); after: gradient elements held once backward is over
    (sequence parallelism's all-reduce of the vectors' gradients), beside ZeRO-1's
    pieces; backward_held: backward's own buffers (`Held`);
    during: (sequence place, bytes) held (or, negative, freed) from the computation
    that makes the tensor at that place on to the end of backward (a pipeline stage's
    messages, its input gradient). `length`: the places of backward's sequence (a launch
    past them, deferred, comes after backward).
    Gradients, flat copies and pieces are of `grad_bytes` an element, the parameters
    the step gathers of `param_bytes`."""
    grads_are_buffers = zero == 2
    flattened = flats = pieces = 0  # gradients flattened; flat copies, pieces held
    peak = beside = 0  # bytes; beside: what backward holds of its own meanwhile
    pending: list[int] = []

    def note(elements: int, own: int = 0) -> None:
        nonlocal peak
        peak = max(peak, elements * grad_bytes + beside + own)

    def wait(flat: int, held: int) -> None:  # held: what is held as the reduction returns
        nonlocal flats, pieces
        if zero == 0:  # the averaged copy is written back into the gradients, then freed
            note(held + flat)
        elif zero == 1:
            pieces += flat // ranks
            note(held + flat // ranks)
        elif accumulate_pieces:
            note(held + flat // ranks)
        flats -= flat

    def holding(made: int) -> int:
        return (made - flattened if grads_are_buffers else 0) + flats + pieces

    def held_from(place: int) -> int:  # backward's own from `during`, at that place
        return sum(nbytes for start, nbytes in during if start <= place) if (
            place < length) else 0

    largest = 0
    states = []  # (gradients flattened, flat copies and pieces held) as each launch comes
    for launch in launches:
        states.append((flattened, flats + pieces))
        beside = held_from(launch.position)
        held = holding(launch.made)  # as the bucket's last gradient is made
        note(held)
        if overlap and in_flight is not None and len(pending) == in_flight:
            wait(pending.pop(0), held)
            held = holding(launch.made)
        flat = launch.numel if zero == 0 else -(-launch.numel // ranks) * ranks
        largest = max(largest, flat)
        note(held + flat)
        flats += flat
        flattened += launch.numel
        if overlap:
            pending.append(flat)
        else:
            wait(flat, holding(launch.made))
    states.append((flattened, flats + pieces))
    if backward_held is not None and len(backward_held.position):
        peak = max(peak, _own_moments_peak(backward_held, launches, states, grads_are_buffers,
                                           grad_bytes, during, length))
    beside = 0
    for flat in pending:  # at the end of backward, every gradient flattened
        wait(flat, flats + pieces)
    note(after)
    if zero == 1:  # then the step all-gathers each bucket's parameters beside them
        peak = max(peak, (pieces + after) * grad_bytes,
                   pieces * grad_bytes + largest * param_bytes)
    return peak


def _own_moments_peak(held: Held, launches: tuple[Launch, ...], states: list[tuple[int, int]],
                      grads_are_buffers: bool, grad_bytes: int,
                      during: tuple[tuple[int, int], ...], length: int) -> int:
    """The largest of reduction_buffers' moments where backward holds buffers of its
    own (`held`): at each, the reduction's state as the first launch at or after it
    found it (`states[k]`, before launch k; the last, after every launch), what `during`
    holds there (nothing for a moment `alone`, or past backward), and its own bytes."""
    reach = np.maximum.accumulate(np.array([launch.position for launch in launches],
                                           dtype=np.int64)) if launches else np.zeros(0)
    k = np.searchsorted(reach, held.position, side="left")
    flattened, buffered = np.array(states, dtype=np.int64).T
    elements = buffered[k] + (held.made - flattened[k] if grads_are_buffers else 0)
    beside = np.zeros(len(held.position), dtype=np.int64)
    for start, nbytes in during:
        beside += np.where(held.position >= start, nbytes, 0)
    beside = np.where(held.alone | (held.position >= length), 0, beside)
    return int((elements * grad_bytes + beside + held.nbytes).max())
