"""The sequence-parallel gradients summed over the TP group once per step, after the
data-parallel sync: Megatron-LM's `finalize_model_grads` ->
`_allreduce_non_tensor_model_parallel_grads` (megatron/core/distributed/
finalize_model_grads.py), called by minipar/train/build.py's
`RankModel.finalize_model_grads`.

A SequenceParallelParameter (sequence.py: the LayerNorms and the row-parallel biases
under sequence parallelism) sees only my tokens, so its gradient is my Partial() summand
over TP. Deferred, it accumulates as such over the step's micro-batches, the data-
parallel engine averages it like any other (both are sums, so DP then TP is the same
math), and one flat all-reduce sums them all: one latency per step instead of one per
parameter and micro-batch. The engines refuse a Partial gradient in clip_grad_norm_ and
step (`require_replicated_gradients`).
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.placement import Partial, PlacementError, Replicate
from minipar.parallel.tensor.sequence import SequenceParallelParameter


def defer_gradient_reduction(named_params) -> list:
    """Move the TP all-reduce of every SequenceParallelParameter among `named_params`
    from each backward to the step (`allreduce_sequence_parallel_grads`). Call before
    the first forward. Returns those (name, parameter) pairs, in order, each once.
    The training loop (train/build.py) defers unless the optimizer is offloaded: then
    the gradient shard goes to the host as its DP reduction completes, leaving no GPU
    gradient to sum after the DP sync, and f keeps summing per backward."""
    deferred, seen = [], set()
    for name, param in named_params:
        if isinstance(param, SequenceParallelParameter) and id(param) not in seen:
            seen.add(id(param))
            param.deferred = True
            deferred.append((name, param))
    return deferred


def allreduce_sequence_parallel_grads(named_params, engine, group) -> None:
    """Sum the deferred sequence-parallel gradients over the TP group in ONE all-reduce:
    Megatron-LM's `_allreduce_non_tensor_model_parallel_grads` (alias
    `_allreduce_layernorm_grads`; megatron/core/distributed/finalize_model_grads.py),
    which `finalize_model_grads` runs after the data-parallel gradient sync:
    `_flatten_dense_tensors` -> all_reduce over TP -> `_unflatten_dense_tensors`.

    named_params: the (name, SequenceParallelParameter) pairs of `defer_gradient_
    reduction`; engine: the DP / ZeRO engine, whose `main_grads` gives for each the
    array the optimizer will read, summed in place (p.grad under DDP, the part of my
    gradient shard that holds it under ZeRO; Megatron's `param.main_grad`). A ZeRO
    shard may hold none of a parameter (an empty array). TP peers hold the same layout
    (same shapes, same DP rank), so their flat buffers line up element by element, as
    Megatron's grad buffers do.
    One call of 2(t-1)/t x (the bytes of these gradients) per step, instead of one per
    parameter and micro-batch; the same bytes as the per-backward path without
    gradient accumulation, 1/A of them with A micro-batches per step.
    """
    named_params = list(named_params)
    if not named_params:  # (no sequence parallelism, or its per-backward path)
        return
    for name, param in named_params:
        if not isinstance(param.grad_placement, Partial):
            raise PlacementError(f"{name}: no Partial() gradient to all-reduce over TP (no "
                                 "backward since the last reduction): a second sum would "
                                 "multiply it by the TP size")
    grads = engine.main_grads([param for _, param in named_params])
    coalesced = dist.hold(np.concatenate([g.reshape(-1) for g in grads]), "buffers")
    if coalesced.size:  # (empty: my ZeRO shard holds none, nor do my TP peers')
        synced = dist.all_reduce(coalesced, group=group, category="buffers")
        offset = 0
        for grad in grads:
            grad[...] = synced[offset:offset + grad.size].reshape(grad.shape)
            offset += grad.size
        dist.release(synced)
    dist.release(coalesced)
    for _, param in named_params:
        param.grad_placement = Replicate()
