"""The gradients of sequence-parallel parameters, made whole over the TP group.

A `SequenceParallelParameter` (the LayerNorms and the row-parallel biases under sequence
parallelism, sequence.py) is replicated but meets only my tokens, so its gradient is my
Partial() summand over TP. It is summed in one of two places:

    per backward (a model used on its own: tests, notebooks): the parameter enters the
        graph through f, whose backward all-reduces its gradient;
    per step (a training run): `defer_gradient_reduction`, then after the data-parallel
        sync `allreduce_sequence_parallel_grads` sums them all in one flat all-reduce,
        as Megatron-LM's `finalize_model_grads` -> `_allreduce_non_tensor_model_parallel_
        grads` (megatron/core/distributed/finalize_model_grads.py), called by
        minipar/train/build.py's `RankModel.finalize_model_grads`: one latency per step
        instead of one per parameter and micro-batch.

Either way a gradient that would reach the optimizer without its sum is refused with a
PlacementError (each TP replica would otherwise step differently): at `.grad` on the
per-backward path, in the engines' clip_grad_norm_ and step on the per-step one.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.placement import Partial, PlacementError, Replicate
from minipar.autograd.tensor import Tensor
from minipar.nn import Parameter
from minipar.parallel.tensor.mappings import copy_to_tensor_parallel_region


class SequenceParallelParameter(Parameter):
    """A replicated parameter that meets only my sequence piece: its gradient from one
    backward is this rank's Partial() summand over the TP group. It becomes whole in
    one of two places:

    per backward (a model used on its own: tests, notebooks): the parameter enters the
        graph through f, whose backward all-reduces its gradient and calls
        `mark_reduced`; a post-accumulate-grad hook (which runs before any
        data-parallel engine's) refuses a gradient that arrives without it.
    per step (`defer_gradient_reduction`: a training run, as Megatron-LM): used as
        is, the gradient accumulates as my summand (`grad_placement` Partial()), the
        data-parallel engine averages it like any other (both are sums, so DP then TP
        is the same math), and `allreduce_sequence_parallel_grads` sums every such
        gradient over TP in one flat all-reduce; the engines refuse a Partial gradient
        in clip_grad_norm_ and step (`require_replicated_gradients`).
    """

    __slots__ = ("name", "reduced", "deferred")

    def mark_reduced(self) -> None:
        self.reduced = True


def _on_gradient_accumulated(param: SequenceParallelParameter) -> None:
    if param.deferred:
        param.grad_placement = Partial()  # my tokens' summand, until the step sums it
        return
    if not param.reduced:
        raise PlacementError(
            f"{param.name}: its gradient is Partial(sum) over the tensor-parallel group "
            "(under sequence parallelism it sees only this rank's tokens) and reached .grad "
            "without the all-reduce of f (copy_to_tensor_parallel_region's backward): the "
            "optimizer and the gradient norm need Replicate(), else each TP replica steps "
            "differently")
    param.reduced = False  # the next backward must reduce again


def sequence_parallel_parameter(param: Parameter, name: str) -> SequenceParallelParameter:
    """`param` (same data, placement and group) as a SequenceParallelParameter."""
    marked = SequenceParallelParameter(param.data, requires_grad=param.requires_grad,
                                       placement=param.placement,
                                       placement_group=param.placement_group)
    marked.grad_category, marked.grad_dtype = param.grad_category, param.grad_dtype
    marked.name, marked.reduced, marked.deferred = name, False, False
    marked.register_post_accumulate_grad_hook(_on_gradient_accumulated)
    return marked


def copy_parameter_to_tensor_parallel_region(param: Parameter, group) -> Tensor:
    """f for a SequenceParallelParameter: all-reduce its gradient in backward and note
    it; a deferred one is used as is (its gradient is summed once per step)."""
    if getattr(param, "deferred", False):
        return param
    return copy_to_tensor_parallel_region(param, group,
                                          on_reduced=getattr(param, "mark_reduced", None))


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
