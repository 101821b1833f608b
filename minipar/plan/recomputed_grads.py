"""The "grads" peak of a step of one micro-batch under recomputation: what backward has
made when a recomputed layer's input gradient is born.

A recomputed layer's input gradient is a leaf gradient while its backward runs
(torch.utils.checkpoint's reentrant variant; selective recomputation's attention core
likewise for its q, k, v), so it counts under "grads" beside the parameters' gradients.
With several micro-batches every parameter gradient exists from the first backward on,
and the peak is all of them plus that input gradient. With one, backward meets the
lowest recomputed layer of the stage (where the input gradient is last alive) while
some parameter gradients are still to come: those of the layers below it (for selective
recomputation, its own norm and QKV, whose backward follows the attention core's) and
the embedding's, a tied wte's too (the engine sums a leaf's contributions, the head's
among them, before its gradient exists: minipar.autograd.engine). So

    peak = max(what the step ends with,  what exists at that moment + the input gradient)

What exists is the parameter gradients made so far under ZeRO-0/1 (they stay until the
step). Under ZeRO-2 a full gradient is a buffer until its bucket is reduce-scattered,
and "grads" holds the rank's reduced pieces: those of the buckets complete by then,
less the last `in_flight` of them when reductions overlap backward (DeepSpeed's
overlap_comm: the oldest is waited for, and its piece kept, only when a further one
starts; minipar.parallel.zero.sharded).

Shapes: `tensors` are the elements of each parameter of one rank (TP share), in
registration order (memory.StageParameters); buckets are tuples of their indices in
the order backward fills them (memory.bucket_tensors).
"""

from __future__ import annotations

from minipar.plan.parameter_order import head_ready, layer_ready, layer_tensors
from minipar.plan.shapes import ModelShape


def later_tensors(shape: ModelShape, tp: int, front: int, first_recomputed: int,
                  selective: bool) -> set[int] | None:
    """Indices of the stage's tensors whose gradients backward makes only after the
    lowest recomputed layer's input gradient is gone; None if it needs a layer's tensors
    and they are not listed one by one.

    front: how many embedding tensors open the stage's list (0 off the first stage);
    first_recomputed: the stage's lowest recomputed layer."""
    per_layer = layer_tensors(shape, tp)
    if len(per_layer) == 1 and (selective or first_recomputed):
        return None
    below = front + first_recomputed * len(per_layer)
    later = set(range(below))
    if selective:
        # backward meets the attention core before the layer's QKV and first norm (the
        # first norms and the QKV weight and bias: parameter_order.layer_tensors)
        norms = 2 if shape.norm == "layernorm" else 1
        qkv = 2 if shape.bias else 1
        later |= set(range(below, below + norms + qkv))
    return later


def completion_order(shape: ModelShape, b: int, tp: int, sequence_parallel: bool,
                     front: int, layers: int, back: int) -> list[tuple]:
    """A key per tensor of the stage (front + layers + back of them, registration order)
    that sorts them as backward completes them: the head, the layers from the last, the
    embedding; inside a module by its share of the module's backward
    (parameter_order.layer_ready / head_ready), ties (a norm's weight and bias, one op)
    in registration order, as the op hands out its gradients."""
    per_layer = layer_ready(shape, b, tp, sequence_parallel)
    head = head_ready(shape, b, tp, (0,) * back) if back else ()
    keys = [(layers + 1, 0.0, j) for j in range(front)]
    for layer in range(layers):
        keys += [(layers - layer, share, j) for j, share in enumerate(per_layer)]
    keys += [(0, share, j) for j, share in enumerate(head)]
    return keys


def grads_peak(tensors: tuple[int, ...], later: set[int], grad_bytes: int, input_grad: int,
               final: int, buckets: tuple[tuple[int, ...], ...] | None = None,
               order: list[tuple] | None = None, ranks: int = 1,
               in_flight: int | None = None) -> int:
    """Peak "grads" bytes of the step (module docstring). final: the bytes the step
    ends with; buckets (ZeRO-2): the gradient buckets, sharded over `ranks`, launched
    as backward completes their last tensor (`order`: completion_order's keys), with at
    most `in_flight` reductions outstanding (None: each waited for as it starts)."""
    if buckets is None:  # ZeRO-0/1: every gradient made stays
        made = sum(n for i, n in enumerate(tensors) if i not in later)
        return max(final, made * grad_bytes + input_grad)
    launched = sorted((max(order[i] for i in bucket), bucket) for bucket in buckets
                      if not later.intersection(bucket))
    if in_flight is not None:
        launched = launched[:max(0, len(launched) - in_flight)]
    pieces = sum(-(-sum(tensors[i] for i in bucket) // ranks) for _, bucket in launched)
    return max(final, pieces * grad_bytes + input_grad)
