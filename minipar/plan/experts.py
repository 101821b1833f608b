"""Mixture of experts and expert parallelism in the planner: what an MoE layer holds,
computes, saves and sends on one rank. The MoE fields of a shape are ModelShape's
(moe_num_experts E, moe_top_k k, moe_capacity_factor c, moe_layer_freq); memory.py,
traffic.py, timing.py and kernels.py call these for each MoE layer of a stage. Tested
against the emulator in tests/plan/test_experts.py.

Per MoE layer and micro-batch of N = b s tokens per rank (minipar/nn/moe.py,
minipar/parallel/expert/dispatch.py; Megatron-LM megatron/core/transformer/moe/):
    capacity       C = ceil(N k / E x c)        (dropless, c None: N k / E, balanced)
    buffer         E x C x d elements (padded to capacity: every slot moves, used or not)
    all-to-alls    4: dispatch and combine forward, and both again in backward
    sent per call  (ep-1)/ep x buffer bytes (one chunk to each peer)
    time per call  (ep-1) alpha + (ep-1)/ep buffer / B (the slowest link of the ep group)
    experts        E / ep local experts, each on the ep x C rows the ranks sent it: the
                   expert FLOPs of E x C rows per rank, whatever ep
Expert parameters per rank: E / ep experts of the MLP's shape (2 d f + f + d elements for
minipar's GELU expert, 3 d f for a bias-free SwiGLU one), split over TP like an MLP
(Megatron's expert tensor parallelism with `expert_tensor_parallel_size` = tp); their
gradients are reduced over the expert-data-parallel group (dp / ep ranks), ZeRO shards
them over it, and the rest of the model over DP (Megatron-LM parallel_state.py;
minipar/train/build.py `expert_data_parallel_engine`).

With TP (minipar/parallel/tensor/model.py `tensor_parallel_experts`) every TP rank routes all
N tokens and sends the whole buffer (the all-to-all bytes do not change with tp); each
local expert all-reduces its (ep x C, d) partial output forward and its input's
gradient backward instead of the MLP's (b, s, d) pair, and with sequence parallelism the
layer all-gathers its input first and its output's gradient in backward (traffic.py).
Megatron routes each TP rank's N/t tokens instead (sequence-parallel dispatch).

What an MoE layer saves for backward beyond the ln_2 output it shares with the dense
MLP's input (minipar's autograd, op by op of MoE.forward): the softmax of the k chosen
logits, the kept mask and the masked gates (N k each), the dispatch buffer the experts
read (E C d), each expert's pre-activation and hidden (E C f each; 3 E C f for SwiGLU),
the combine's gathered outputs (N k d), the router's softmax over all experts (N E), the
tokens per expert (E) and the aux loss's scale (1). Real MoE kernels (Megatron's
grouped GEMM and permute fusion) save less; these are minipar's.

FLOPs (minipar's conventions, plan/shapes.py): the experts' GEMMs, biases and activation
on E C rows; the router GEMM 2 N d E; two softmaxes 5 N (k + E); the gating, combine and
aux-loss products and sums; backward twice the GEMMs and the gathers' scatter-adds.
"""

from __future__ import annotations

import math

from minipar.distributed.clock import collective_time
from minipar.nn.moe import capacity
from minipar.plan.shapes import ACTIVATION_FLOPS, DROPOUT_FLOPS, SOFTMAX_FLOPS, ModelShape


def expert_capacity(shape: ModelShape, tokens: int) -> int:
    """Slots per expert C for `tokens` tokens per rank (minipar.nn.moe.capacity); a
    dropless MoE (capacity factor None) is planned as perfectly balanced, C = N k / E."""
    e, k = shape.moe_num_experts, shape.moe_top_k
    if shape.moe_capacity_factor is None:
        return math.ceil(tokens * k / e)
    return capacity(tokens, e, k, shape.moe_capacity_factor)


def dispatch_rows(shape: ModelShape, b: int) -> int:
    """Rows of the dispatch buffer, E x C, for b sequences: the tokens the experts of one
    rank's worth of work see (the E/ep local experts each take ep x C of them)."""
    return shape.moe_num_experts * expert_capacity(shape, b * shape.seq_len)


def buffer_bytes(shape: ModelShape, b: int, itemsize: int) -> int:
    """Bytes of the (E, C, d) dispatch buffer: the S of each all-to-all."""
    return dispatch_rows(shape, b) * shape.d_model * itemsize


# ------------------------------------------------------------------ parameters
def expert_layer_params(shape: ModelShape, tp: int, ep: int) -> int:
    """Expert parameter elements of one MoE layer on one rank: E / ep experts, each an
    MLP's TP share."""
    return shape.moe_num_experts // ep * sum(shape.mlp_params(tp))


def dense_layer_params(shape: ModelShape, tp: int) -> int:
    """Non-expert parameter elements of one MoE layer on one TP rank: attention, norms
    and the router (replicated over TP, as Megatron's TopKRouter)."""
    return sum(shape.layer_params(tp)) - sum(shape.mlp_params(tp)) + shape.router_params


def expert_parameter_bytes(shape: ModelShape, ep: int, itemsize: int, tp: int = 1) -> int:
    """Bytes of expert parameters one rank holds: E / ep experts in every MoE layer."""
    return shape.n_moe_layers * expert_layer_params(shape, tp, ep) * itemsize


# ------------------------------------------------------------------ traffic
def all_to_all_sent_per_call(shape: ModelShape, b: int, ep: int, itemsize: int) -> int:
    """Bytes one rank sends in one all-to-all of an MoE layer: (ep-1)/ep of the buffer."""
    return (ep - 1) * buffer_bytes(shape, b, itemsize) // ep


def all_to_all_per_step(shape: ModelShape, b: int, ep: int, micro_batches: int,
                        itemsize: int, moe_layers: int | None = None) -> dict:
    """The all-to-alls of one optimizer step of one rank: calls and bytes sent (four per
    MoE layer and micro-batch; moe_layers: the rank's, default the whole model's)."""
    layers = shape.n_moe_layers if moe_layers is None else moe_layers
    calls = 4 * layers * micro_batches if ep > 1 else 0
    return {"calls": calls,
            "sent_bytes": calls * all_to_all_sent_per_call(shape, b, ep, itemsize)}


def all_to_all_seconds(shape: ModelShape, b: int, ep: int, micro_batches: int,
                       itemsize: int, alpha: float, bandwidth: float) -> float:
    """Simulated seconds of one step's all-to-alls on one rank (alpha-beta, blocking)."""
    calls = all_to_all_per_step(shape, b, ep, micro_batches, itemsize)["calls"]
    return calls * collective_time("all_to_all", ep, buffer_bytes(shape, b, itemsize),
                                   alpha, bandwidth)


# ------------------------------------------------------------------ placement
def chunk_moe_layers(shape: ModelShape, stage) -> tuple[int, ...]:
    """MoE layers of each chunk of `stage` (a layout.StagePlan): the multiples of
    moe_layer_freq among the model's layers it holds, from `stage.chunk_starts`."""
    if not shape.is_moe:
        return (0,) * len(stage.chunk_layers)
    return tuple(shape.moe_layers_in(start, start + n)
                 for start, n in zip(stage.chunk_starts, stage.chunk_layers, strict=True))


def stage_moe_layers(shape: ModelShape, stage) -> int:
    """MoE layers of `stage`, all its chunks'."""
    return sum(chunk_moe_layers(shape, stage))


# ------------------------------------------------------------------ compute
def recomputed_layers(shape: ModelShape, config, stage) -> tuple[int, int]:
    """(dense, MoE) layers of `stage` (a layout.StagePlan) that full recomputation runs
    again: every layer of a chunk (uniform) or its first k (block; nn/recompute.py), an
    MoE layer where the model's index is a multiple of moe_layer_freq, counted from where
    each chunk starts (`stage.chunk_starts`)."""
    again = [config.recompute.recomputed_layers(n) for n in stage.chunk_layers]
    total = sum(again)
    if not stage_moe_layers(shape, stage):
        return total, 0
    moe = sum(shape.moe_layers_in(start, start + k)
              for start, k in zip(stage.chunk_starts, again, strict=True))
    return total - moe, moe


def _feed_forward_flops(shape: ModelShape, rows: int, output_rows: int, tp: int
                        ) -> tuple[float, float]:
    """(forward, backward) FLOPs of the MLP's GEMMs, activation and biases over `rows`
    tokens (each TP rank holds 1/tp of the hidden width); the output bias is added on
    `output_rows` (the sequence piece under SP for a dense MLP)."""
    h, f = shape.d_model, shape.ffn
    matmul = 2 * rows * h * (shape.mlp_in_width + f) / tp
    act_f, act_b = ACTIVATION_FLOPS[shape.mlp]
    forward, backward = matmul + act_f * rows * f / tp, 2 * matmul + act_b * rows * f / tp
    if shape.bias:
        bias = rows * shape.mlp_in_width / tp + output_rows * h
        forward, backward = forward + bias, backward + bias
    return forward, backward


def mlp_flops(shape: ModelShape, b: int, tp: int = 1, sequence_parallel: bool = False
              ) -> tuple[float, float]:
    """(forward, backward) FLOPs of one dense MLP in shapes.layer_flops: the part of a
    layer an MoE replaces (its GEMMs, activation, biases and residual dropout)."""
    h, tokens = shape.d_model, b * shape.seq_len
    stream = tokens // tp if sequence_parallel else tokens
    forward, backward = _feed_forward_flops(shape, tokens, stream, tp)
    if shape.dropout > 0:
        forward += DROPOUT_FLOPS[0] * stream * h
        backward += DROPOUT_FLOPS[1] * stream * h
    return forward, backward


def moe_flops(shape: ModelShape, b: int, tp: int = 1) -> tuple[float, float]:
    """(forward, backward) FLOPs of one MoE MLP on one rank (see the module docstring)."""
    h, e, k = shape.d_model, shape.moe_num_experts, shape.moe_top_k
    n, rows = b * shape.seq_len, dispatch_rows(shape, b)
    forward, backward = _feed_forward_flops(shape, rows, rows, tp)  # the experts' rows
    router = 2 * n * h * e
    softmax = n * (k + e)  # the k chosen logits' softmax (gates), all E (aux loss)
    products = n * k + n * k * h + e + 1  # gates x kept, outputs x gates, f_e P_e, x coeff
    sums = n * k * h + n * e + e  # combine over k, P_e over tokens, over experts
    gathers = n * k + rows * h + n * k * h + rows * h  # chosen logits, dispatch, combine,
    # and each local expert's rows of the received buffer: scatter-added in backward
    # (the aux loss joins the gradients in backward, MoEAuxLossAutoScaler: no add)
    forward += router + SOFTMAX_FLOPS[0] * softmax + products + sums
    backward += 2 * router + SOFTMAX_FLOPS[1] * softmax + 2 * products + sums + gathers
    return forward, backward


def moe_flops_delta(shape: ModelShape, b: int, tp: int = 1, sequence_parallel: bool = False
                    ) -> tuple[float, float]:
    """(forward, backward) FLOPs an MoE layer adds to a dense one's."""
    moe, mlp = moe_flops(shape, b, tp), mlp_flops(shape, b, tp, sequence_parallel)
    return moe[0] - mlp[0], moe[1] - mlp[1]


# ------------------------------------------------------------------ activations
def moe_activation_bytes(shape: ModelShape, b: int, tp: int, activation_bytes: int) -> int:
    """Bytes one MoE MLP saves for backward on one rank beyond its input (see above)."""
    h, f, e, k = shape.d_model, shape.ffn, shape.moe_num_experts, shape.moe_top_k
    n, rows = b * shape.seq_len, dispatch_rows(shape, b)
    hidden = 3 if shape.mlp == "swiglu" else 2
    elements = 3 * n * k + rows * h + hidden * rows * f // tp + n * k * h + n * e + e + 1
    return elements * activation_bytes


def moe_activation_delta(shape: ModelShape, b: int, tp: int, sequence_parallel: bool,
                         activation_bytes: int) -> int:
    """Bytes an MoE layer saves beyond a dense one (shapes.layer_activation_bytes counts
    the dense MLP's hidden activations and, with dropout, its residual dropout's mask)."""
    tokens = b * shape.seq_len
    hidden = 3 if shape.mlp == "swiglu" else 2
    dense = hidden * tokens * shape.ffn // tp * activation_bytes
    if sequence_parallel and tp > 1:  # the layer's all-gathered (N, d) input (router and
        # dispatch read it) instead of the MLP-in's (N/t, d) piece
        dense -= (tokens - tokens // tp) * shape.d_model * activation_bytes
    if shape.dropout > 0:
        dense += (tokens // tp if sequence_parallel else tokens) * shape.d_model
    return moe_activation_bytes(shape, b, tp, activation_bytes) - dense
