"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2), from one rank's point of view.

Tensor parallelism (tensor_layers.py) splits attention heads and the MLP hidden layer,
but every TP rank still holds the whole (B, T, d) activations of the LayerNorms, the
dropouts and the residual stream: they sit between the all-reduces, replicated. Sequence
parallelism cuts those regions along the sequence: rank i keeps tokens [i T/t, (i+1) T/t).

The all-reduce at the end of a tensor-parallel region is a reduce-scatter followed by an
all-gather, so it splits in two at no extra cost (the paper's figure 6):

    sequence-parallel region  --all-gather-->      tensor-parallel region     (g)
    tensor-parallel region    --reduce-scatter-->  sequence-parallel region   (g-bar)

Those region functions are in mappings.py (Megatron-LM's mappings.py names; the paper
calls the first `g` and the second `g-bar`, not to be confused with Shoeybi et al.'s f
and g). This module holds the layers that run on a sequence piece:

`SequenceParallelLinear` is the column-parallel linear layer entered from a sequence-
parallel region. Saving its all-gathered (B, T, d) input for backward would give back
what sequence parallelism saved, so, as Megatron does, it saves only this rank's
(B, T/t, d) piece and all-gathers it again in backward to form the weight gradient
(the paper: "an extra all-gather ... in the backward pass"; Megatron overlaps it with
the input-gradient matmul, we run it first).

`SequenceParallelLayerNorm` and the row-parallel biases use replicated parameters on my
tokens only, so their gradients are partial sums over the TP group. They are
`SequenceParallelParameter`s (Megatron marks them `param.sequence_parallel = True`).
Megatron sums their gradients once per step, after the data-parallel sync, in one
flat all-reduce over TP (`finalize_model_grads` ->
`_allreduce_non_tensor_model_parallel_grads`, megatron/core/distributed/
finalize_model_grads.py); the training loop does the same here
(`defer_gradient_reduction`, `allreduce_sequence_parallel_grads`, called by
minipar/train/build.py's `RankModel.finalize_model_grads`): one latency per step
instead of one per parameter and micro-batch. A model used on its own keeps the
per-backward path: the parameters enter the graph through f, whose backward
all-reduces each gradient, so `.grad` is whole after every backward. Either way a
gradient that would reach the optimizer without its TP sum is refused with a
PlacementError (each TP replica would otherwise take a different optimizer step): at
`.grad` on the per-backward path, in the engines' clip_grad_norm_ and step on the
per-step one.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd import functional as F
from minipar.autograd.function import Function
from minipar.autograd.kernels import linear_kernels
from minipar.autograd.placement import Partial, PlacementError, Replicate
from minipar.autograd.precision import bfloat16, float32
from minipar.autograd.tensor import Tensor
from minipar.nn import LayerNorm, Parameter
from minipar.parallel.tensor.mappings import SEQUENCE_DIM, copy_to_tensor_parallel_region


# ---------------------------------------------------------------------------- linear
def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """2-D a @ b; bf16 in, fp32 accumulate (a tensor core), result in fp32 for bf16."""
    if a.dtype == bfloat16:
        return a.astype(float32) @ b.astype(float32)
    return a @ b


class SequenceParallelLinear(Function):
    """y = all_gather(x) @ W + b, saving only this rank's piece of x for backward.

    x: (B, T/t, in) sequence piece; weight: (in, out/t), or (out/t, in) used transposed
    (the vocab-parallel LM head); bias: (out/t,) or None; returns (B, T, out/t).
    Backward: all-gather x again (for dW), dx = reduce_scatter(dy @ W^T) along T.
    Same arithmetic and FLOPs as minipar.autograd.functional.Linear.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, transpose_weight, group):
        full = dist.all_gather(x, group=group, dim=SEQUENCE_DIM)  # (B, T, in)
        w = weight.T if transpose_weight else weight
        x2 = full.reshape(-1, full.shape[-1])
        y = _matmul(x2, w)
        if bias is not None:
            y += bias.astype(y.dtype, copy=False)
        # Only the piece: 1/t of the input, the memory sequence parallelism is for.
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.transpose_weight = group, transpose_weight
        m, n = y.shape
        ctx.flops_forward = 2 * m * x2.shape[1] * n + (m * n if bias is not None else 0)
        ctx.flops_backward = 4 * m * x2.shape[1] * n + (m * n if bias is not None else 0)
        ctx.kernels_forward, ctx.kernels_backward = linear_kernels(
            m, n, x2.shape[1], x.dtype.itemsize, bias is not None)
        # per argument, the kernels of its gradient (the split backward's B takes dx,
        # W the weight GEMM with the bias in its epilogue: engine.backward_input)
        ctx.backward_by_input = ((ctx.kernels_backward[0],), (ctx.kernels_backward[1],),
                                 (), (), ())
        return y.astype(x.dtype, copy=False).reshape(*full.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group = ctx.group
        dtype = grad.dtype
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        full = None
        if need_w:
            # The extra all-gather of Korthikanti et al.: the full input is a transient
            # buffer again, alive only while the weight gradient is formed.
            full = dist.all_gather(x, group=group, dim=SEQUENCE_DIM, category="buffers")
        if need_x:
            w = weight if ctx.transpose_weight else weight.T  # (out/t, in)
            dx = _matmul(g2, w).astype(dtype, copy=False)
            dx = dx.reshape(*grad.shape[:-1], dx.shape[-1])  # (B, T, in), a partial sum
            grad_x = dist.reduce_scatter(dx, group=group, dim=SEQUENCE_DIM)
        if need_w:
            f2 = full.reshape(-1, full.shape[-1])
            dw = _matmul(g2.T, f2) if ctx.transpose_weight else _matmul(f2.T, g2)
            grad_w = dw.astype(dtype, copy=False)
            dist.release(full)
        if need_b:
            work = float32 if dtype == bfloat16 else dtype
            grad_b = g2.sum(axis=0, dtype=work).astype(dtype, copy=False)
        return grad_x, grad_w, grad_b, None, None


def sequence_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group,
                             transpose_weight: bool = False) -> Tensor:
    """Column-parallel linear entered from the sequence-parallel region; see
    `SequenceParallelLinear`."""
    return SequenceParallelLinear.apply(x, weight, bias, transpose_weight, group)


# ---------------------------------------------------------------------------- parameters
class SequenceParallelParameter(Parameter):
    """A replicated parameter that meets only my sequence piece: its gradient from one
    backward is this rank's Partial() summand over the TP group. It becomes whole in
    one of two places:

    per backward (a model used on its own: tests, notebooks): the parameter enters the
        graph through f, whose backward all-reduces its gradient and calls
        `mark_reduced`; a post-accumulate-grad hook (which runs before any
        data-parallel engine's) refuses a gradient that arrives without it.
    per step (`defer_gradient_reduction`: the training loop, as Megatron-LM): used as
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
    marked.grad_category = param.grad_category
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


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on a sequence piece (B, T/t, d). Weight and bias are replicated but see
    only my tokens, so their gradients are summed over the TP group: by f's backward, or
    once per step when deferred (see SequenceParallelParameter). `name` (e.g.
    "h.0.ln_1") names them in placement errors."""

    def __init__(self, layer_norm: LayerNorm, group, name: str = "LayerNorm"):
        super().__init__(layer_norm.weight.shape[0], layer_norm.eps,
                         dtype=layer_norm.weight.dtype)
        self.weight = sequence_parallel_parameter(layer_norm.weight, f"{name}.weight")
        self.bias = sequence_parallel_parameter(layer_norm.bias, f"{name}.bias")
        self.group = group

    def forward(self, x):
        return F.layer_norm(x, copy_parameter_to_tensor_parallel_region(self.weight, self.group),
                            copy_parameter_to_tensor_parallel_region(self.bias, self.group),
                            self.eps)
