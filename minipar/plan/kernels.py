"""The kernels of one micro-batch on one rank: what the roofline prices.

shapes.py counts a layer's FLOPs; a GPU's time also depends on how they are grouped into
kernels: a GEMM's shape sets its tensor-core efficiency, an elementwise op costs the
bytes it streams through HBM (minipar.distributed.roofline). This module lists the
kernels of a layer, the embedding, the head and the optimizer, per TP rank, for b
sequences of s tokens (T = b s tokens; T_r = the tokens of the replicated stream, T/t
with sequence parallelism; e = bytes per activation element):

  forward of a layer                                  bytes besides a GEMM's operands
    norm 1                                            read x, write y        2e T_r h
    QKV GEMM (T, h) @ (h, qkv/t) (+ bias epilogue)
    attention  q k^T  (b a/t) x (s, d) @ (d, s)       [fused: one kernel, reads q k v,
               scale-mask-softmax                     writes o, Dao et al. 2022]
                 read scores, write probabilities     2e b a/t s^2
               dropout (p > 0): read, write, mask     (2e + 1) b a/t s^2
               p v  (b a/t) x (s, s) @ (s, d)
    output projection (T, h/t) @ (h/t, h)
    residual add (+ row-parallel bias, dropout)       read 2, write 1: 3e T_r h (+ mask)
    norm 2, MLP-in GEMM (+ bias), activation (read the pre-activation, write the hidden),
    MLP-out GEMM, residual add
  backward: every GEMM becomes two (input and weight gradient), every elementwise kernel
    reads its input and the output gradient and writes the input gradient.

This is Megatron-LM's kernel set (megatron/model/transformer.py, fused_softmax.py,
fused_bias_gelu.py, fused_bias_dropout_add): biases fused into the GEMM or the next
elementwise kernel, one fused scale-mask-softmax. minipar's autograd reports the same
kernels for its Linear, attention and elementwise ops (minipar.autograd.kernels), so the
emulator's roofline profiles and the planner price one op list. FLOPs sum to shapes.py's
counts exactly (the attention dropout's FLOPs are counted in the softmax's, as there).
"""

from __future__ import annotations

from dataclasses import replace

from minipar.autograd.kernels import (
    FusedAttention,
    Kernel,
    attention_kernels,
    flash_causal_share,
    gemm_kernel,
    linear_backward_kernels,
    linear_kernels,
    ring_attention_block_kernels,
)
from minipar.plan.context import busiest_pairs, chunk_tokens, diagonal_share, local_shape
from minipar.plan.experts import dispatch_rows, recomputed_layers, stage_moe_layers
from minipar.plan.fp8 import FP8, fp8_linear_kernels, gemm_weights, weight_cast_kernels
from minipar.plan.layout import ParallelConfig, StagePlan, checkpointed_layers
from minipar.plan.memory import sharded_numel, stage_parameters
from minipar.plan.shapes import (
    ACTIVATION_FLOPS,
    ADAMW_FLOPS_PER_PARAMETER,
    CROSS_ENTROPY_FLOPS,
    DROPOUT_FLOPS,
    NORM_FLOPS,
    ROPE_FLOPS,
    SOFTMAX_FLOPS,
    ModelShape,
    padded_vocab,
)


def layer_kernels(shape: ModelShape, b: int, tp: int = 1, sequence_parallel: bool = False,
                  itemsize: int = 2, flash_attention: bool = False,
                  ring: tuple[int, int] | None = None, moe_ep: int | None = None,
                  fp8: bool = False) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels of one layer on one TP rank for b sequences
    (layer_weight_kernels's arguments)."""
    forward, backward, _ = layer_weight_kernels(shape, b, tp, sequence_parallel, itemsize,
                                                flash_attention, ring, moe_ep, fp8)
    return forward, backward


def layer_weight_kernels(shape: ModelShape, b: int, tp: int = 1,
                         sequence_parallel: bool = False, itemsize: int = 2,
                         flash_attention: bool = False, ring: tuple[int, int] | None = None,
                         moe_ep: int | None = None, fp8: bool = False
                         ) -> tuple[list[Kernel], list[Kernel], list[Kernel]]:
    """(forward, backward, weight) kernels of one layer on one TP rank for b sequences;
    weight: of the backward, the weight gradients (the zero-bubble schedules' W): each
    linear layer's dW GEMM, the last of its backward kernels, and the row-parallel
    biases' sums (ModelShape.layer_weight_flops; an MoE layer's experts are not in it).
    ring:
    (chunk tokens, chunk pairs) of context parallelism's ring attention, whose blocks
    replace the attention kernels (shape then holds one CP rank's s/cp tokens). moe_ep:
    an MoE layer's, expert-parallel over moe_ep ranks (`moe_kernels` replace its MLP).
    fp8: the four linear layers' GEMMs in FP8, as Transformer Engine runs them
    (plan/fp8.py): the norms write their output in FP8 for the GEMM after them (TE's
    LayerNormLinear), the other two cast their inputs."""
    h, s, f, e = shape.d_model, shape.seq_len, shape.ffn, itemsize
    gemm_in = FP8 if fp8 else e  # bytes per element of a linear layer's input
    tokens = b * s
    stream = tokens // tp if sequence_parallel else tokens
    qkv, mlp_in = shape.qkv_width // tp, shape.mlp_in_width // tp
    bias = shape.bias
    norm_f, norm_b = NORM_FLOPS[shape.norm]
    act_f, act_b = ACTIVATION_FLOPS[shape.mlp]
    dropout = shape.dropout > 0

    def elementwise(flops_f, bytes_f, flops_b, bytes_b) -> tuple[tuple, tuple]:
        return (Kernel(flops_f, bytes_f),), (Kernel(flops_b, bytes_b),)

    def norm():  # reads x, writes y; backward reads x and dy, writes dx
        return elementwise(norm_f * stream * h, (e + gemm_in) * stream * h,
                           norm_b * stream * h, 3 * e * stream * h)

    def linear(m, n, k, bias, after_norm=False):
        """A linear layer's kernels; under FP8 (plan/fp8.py), after_norm: its input is the
        norm's FP8 output (LayerNormLinear); a row-parallel layer (not after a norm)
        all-gathers its output's gradient under sequence parallelism."""
        if fp8:
            gathered = tp if sequence_parallel and not after_norm else 1
            return fp8_linear_kernels(m, n, k, e, bias, after_norm, gathered)
        return linear_kernels(m, n, k, e, bias)

    def residual(bias=bias, dropout=dropout):  # the add, the row-parallel bias and the
        mask = stream * h if dropout else 0      # dropout fused (bias_dropout_add)
        return elementwise((1 + bias + (DROPOUT_FLOPS[0] if dropout else 0)) * stream * h,
                           3 * e * stream * h + mask,
                           (1 + bias + (DROPOUT_FLOPS[1] if dropout else 0)) * stream * h,
                           3 * e * stream * h + mask)

    forward: list[Kernel] = []
    backward: list[Kernel] = []
    weight: list[Kernel] = []

    def add(kernels: tuple[tuple, tuple]) -> None:
        forward.extend(kernels[0])
        backward.extend(kernels[1])

    def add_linear(*args, **kwargs) -> None:
        kernels = linear(*args, **kwargs)
        add(kernels)
        # dW = x^T dy, after dx (and any cast of dy; under FP8 TE sums a bias's
        # gradient in that cast, which is B's)
        weight.append(kernels[1][-1])

    if bias:  # the row-parallel biases' gradients, summed in the residual's backward
        weight.append(Kernel(2 * stream * h, 0.0))
    add(norm())
    add_linear(tokens, qkv, h, bias, after_norm=True)
    if shape.position == "rope":
        rotated = tokens * (h + shape.kv_dim) // tp
        add(elementwise(ROPE_FLOPS[0] * rotated, 2 * e * rotated,
                        ROPE_FLOPS[1] * rotated, 2 * e * rotated))
    add(attention_core_kernels(shape, b, tp, itemsize, flash_attention, ring))
    add_linear(tokens, h, h // tp, False)  # its bias is in the residual add
    add(residual())
    add(norm())
    if moe_ep is not None:  # the experts hold their biases; an MoE MLP has no dropout
        add(moe_kernels(shape, b, tp, moe_ep, itemsize))
        add(residual(bias=False, dropout=False))
        return forward, backward, weight
    add_linear(tokens, mlp_in, h, bias, after_norm=True)
    hidden = shape.ffn // tp
    add(elementwise(act_f * tokens * hidden, e * tokens * (mlp_in + hidden),
                    act_b * tokens * hidden, e * tokens * (2 * mlp_in + hidden)))
    add_linear(tokens, h, f // tp, False)
    add(residual())
    return forward, backward, weight


def moe_kernels(shape: ModelShape, b: int, tp: int, ep: int, itemsize: int = 2
                ) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels of an MoE MLP on one rank (plan/experts.py's FLOPs):
    the router GEMM (N, d) @ (d, E); the routing (two softmaxes, gates, aux loss); the
    dispatch gather into the (E, C, d) buffer; each of the E/ep local experts' GEMMs on
    its ep x C rows (as Megatron's SequentialMLP; its GroupedMLP batches them) and its
    activation; the combine (gather, scale by the gates, sum over k). Backward: the GEMMs'
    gradients, the elementwise ops', and the gathers' scatter-adds."""
    h, f, e = shape.d_model, shape.ffn, itemsize
    experts, k = shape.moe_num_experts, shape.moe_top_k
    n, rows = b * shape.seq_len, dispatch_rows(shape, b)
    local, per_expert = experts // ep, rows // experts * ep  # ep x C rows each
    mlp_in, hidden = shape.mlp_in_width // tp, f // tp
    act_f, act_b = ACTIVATION_FLOPS[shape.mlp]
    softmax = n * (k + experts)
    products, sums = n * k + experts + 1, n * experts + experts  # routing, aux loss
    combine = n * k * h
    router_f, router_b = linear_kernels(n, experts, h, e, False)
    forward = [*router_f,
               Kernel(SOFTMAX_FLOPS[0] * softmax + products + sums, 3 * e * softmax),
               Kernel(0, 2 * e * rows * h)]  # dispatch: read the tokens, write the buffer
    backward = [*router_b,
                Kernel(SOFTMAX_FLOPS[1] * softmax + 2 * products + sums + n * k,
                       4 * e * softmax),
                Kernel(2 * rows * h, 3 * e * rows * h)]  # the two scatter-adds of dispatch
    # every local expert runs the same kernels: one expert's, met `local` times (the same
    # objects, which Roofline.total_seconds prices once)
    fc_f, fc_b = linear_kernels(per_expert, mlp_in, h, e, shape.bias)
    proj_f, proj_b = linear_kernels(per_expert, h, hidden, e, shape.bias)
    forward += [*fc_f, Kernel(act_f * per_expert * hidden,
                              e * per_expert * (mlp_in + hidden)), *proj_f] * local
    backward += [*proj_b, Kernel(act_b * per_expert * hidden,
                                 e * per_expert * (2 * mlp_in + hidden)), *fc_b] * local
    # combine: gather (N, k, d), times the gates, summed over k
    forward.append(Kernel(2 * combine, e * (rows * h + combine + n * h)))
    backward.append(Kernel(4 * combine, e * (n * h + 2 * combine + rows * h)))
    return forward, backward


def attention_core_kernels(shape: ModelShape, b: int, tp: int = 1, itemsize: int = 2,
                           flash_attention: bool = False, ring: tuple[int, int] | None = None
                           ) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """(forward, backward) kernels of the attention core softmax(QK^T)V of my heads: what
    selective recomputation runs again in backward. ring: (chunk tokens, chunk pairs) of
    context parallelism's ring attention, whose blocks are then the core (shape holds
    one CP rank's s/cp tokens)."""
    if ring is not None:  # each chunk pair's kernels (minipar/parallel/context/ring_attention.py)
        chunk, pairs = ring
        block_f, block_b = ring_attention_block_kernels(b * shape.n_head // tp, chunk,
                                                        shape.head_dim, itemsize,
                                                        flash_attention)
        if flash_attention:  # one fused kernel per pair; `pairs` counts a causal pair's share
            return tuple((replace(k, flops=pairs * k.flops, nbytes=pairs * k.nbytes,
                                  attention=replace(k.attention,
                                                    flops=pairs * k.attention.flops)),)
                         for k in (block_f[0], block_b[0]))
        return block_f * pairs, block_b * pairs
    h, s, e = shape.d_model, shape.seq_len, itemsize
    tokens = b * s
    heads = b * shape.n_head // tp  # (sequence, head) pairs of my heads
    d = shape.head_dim
    scores = heads * s * s
    if flash_attention:  # one kernel: reads q, k, v, writes o (and dO, dq, dk, dv back)
        # causal: the kernel skips the key blocks above the diagonal
        attention = 4 * heads * s * s * d * flash_causal_share(s)
        q_k_v_o = e * tokens * (shape.qkv_width // tp + h // tp)
        benchmarked = 4 * heads * s * s * d / 2  # its benchmarks' causal count
        return ((Kernel(attention + SOFTMAX_FLOPS[0] * scores, q_k_v_o, gemm=(heads, s, d, s),
                        attention=FusedAttention(False, True, s, d, benchmarked)),),
                (Kernel(2 * attention + SOFTMAX_FLOPS[1] * scores, 2 * q_k_v_o,
                        gemm=(heads, s, d, s),
                        attention=FusedAttention(True, True, s, d, 2.5 * benchmarked)),))
    return attention_kernels(heads, s, d, e, shape.dropout > 0)


def embedding_kernels(shape: ModelShape, b: int, tp: int = 1, itemsize: int = 2
                      ) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels of the embedding: a gather of T rows (and the position
    add, norm, dropout fused after it), and its backward's scatter-add."""
    f, bw = shape.embedding_flops(b, tp)
    rows = b * shape.seq_len * shape.d_model
    passes = 1 + (shape.position == "learned") + shape.embedding_norm + (shape.dropout > 0)
    return ([Kernel(f, 2 * itemsize * rows * passes)],
            [Kernel(bw, 3 * itemsize * rows * passes)])


def cross_entropy_bytes(itemsize: int, fused: bool = True) -> tuple[int, int]:
    """Bytes per logit that the loss moves through HBM, forward and backward.

    fused: one kernel each way (minipar's CrossEntropy op, Megatron-LM's
    --cross-entropy-loss-fusion): read the logits, write the probabilities; backward read
    those, write the logits' gradient: 2e and 2e. Unfused: Megatron-LM's
    vocab_parallel_cross_entropy (megatron/core/tensor_parallel/cross_entropy.py, its
    default), op by op in fp32: cast the logits (read e, write 4), max (read 4), subtract
    it in place (8), exp in place (8), sum (4), divide in place (8); backward, the
    gradient scaled in place (8) and cast back (read 4, write e): e + 36 and e + 12."""
    if fused:
        return 2 * itemsize, 2 * itemsize
    return itemsize + 36, itemsize + 12


def head_kernels(shape: ModelShape, b: int, tp: int = 1, sequence_parallel: bool = False,
                 itemsize: int = 2, fused_loss: bool = True
                 ) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels of the final norm, the logits GEMM (T, h) @ (h, V/t)
    and the cross-entropy over my vocabulary slice (its bytes per logit:
    cross_entropy_bytes)."""
    forward, backward, _ = head_weight_kernels(shape, b, tp, sequence_parallel, itemsize,
                                               fused_loss)
    return forward, backward


def head_weight_kernels(shape: ModelShape, b: int, tp: int = 1,
                        sequence_parallel: bool = False, itemsize: int = 2,
                        fused_loss: bool = True
                        ) -> tuple[list[Kernel], list[Kernel], list[Kernel]]:
    """head_kernels, and of the backward the logits GEMM's weight gradient (its W)."""
    h, e = shape.d_model, itemsize
    tokens = b * shape.seq_len
    stream = tokens // tp if sequence_parallel else tokens
    vocab = padded_vocab(shape.vocab_size, tp) // tp
    norm_f, norm_b = NORM_FLOPS[shape.norm]
    logits = tokens * vocab
    loss_f, loss_b = cross_entropy_bytes(e, fused_loss)
    forward = [Kernel(norm_f * stream * h, 2 * e * stream * h),
               gemm_kernel(1, tokens, vocab, h, e),
               Kernel(CROSS_ENTROPY_FLOPS[0] * logits, loss_f * logits)]
    dx, dw = linear_backward_kernels(1, tokens, vocab, h, e)
    backward = [Kernel(CROSS_ENTROPY_FLOPS[1] * logits, loss_b * logits), dx, dw,
                Kernel(norm_b * stream * h, 3 * e * stream * h)]
    return forward, backward, [dw]


def optimizer_kernel(elements: int, config: ParallelConfig) -> Kernel:
    """AdamW over `elements` parameters: 14 FLOPs each; reads and writes the optimizer
    state (fp32 master weights and moments under mixed precision) and the parameter,
    reads the gradient."""
    per = config.bytes
    return Kernel(ADAMW_FLOPS_PER_PARAMETER * elements,
                  elements * (2 * per.optimizer + per.grad + 2 * per.param))


def stage_kernels(shape: ModelShape, config: ParallelConfig, stage: StagePlan
                  ) -> dict[str, list[tuple[int, list[Kernel]]]]:
    """Kernels of one micro-batch's forward and backward (with full recomputation the
    backward runs each checkpointed layer's forward again first, with selective
    recomputation each layer's attention core) and of the optimizer step on one
    rank of `stage`, as (times, kernels) groups: the layers' kernels run `stage.layers`
    times; and, of the backward, the weight gradients ("weight": the zero-bubble
    schedules' W). The kernel list behind timing.stage_compute's FLOPs."""
    b, t, sp = config.micro_batch_size, config.tp, config.sequence_parallel
    e = config.bytes.activation
    full, shape = shape, local_shape(shape, config.cp)  # my s/cp tokens of each sequence
    ring = None
    if config.cp > 1:
        chunk = chunk_tokens(full.seq_len, config.cp, config.cp_load_balance)
        ring = (chunk, busiest_pairs(config.cp, config.cp_load_balance,
                                     diagonal=diagonal_share(chunk, config.flash_attention)))
    fp8 = config.fp8_format is not None
    layer_f, layer_b, layer_w = layer_weight_kernels(shape, b, t, sp, e,
                                                     config.flash_attention, ring, fp8=fp8)
    # (an MoE layer's W counted as a dense one's; a checkpointed layer's is in B)
    weight = [(stage.layers - checkpointed_layers(config, stage), layer_w)]
    recompute = config.recompute
    moe = stage_moe_layers(shape, stage)
    dense = stage.layers - moe
    forward = [(dense, layer_f)]
    if fp8:  # the FP8 weights, cast once a step: a micro-batch's share
        forward.append((dense / config.micro_batches,
                        weight_cast_kernels(gemm_weights(full, t), e,
                                            config.replicas if config.fp8_param_gather
                                            else 0)))
    core_f: tuple = ()
    if recompute.full:  # the checkpointed layers run their forward again first
        dense_again, moe_again = recomputed_layers(shape, config, stage)
        backward = [(dense_again, layer_f + layer_b), (dense - dense_again, layer_b)]
    elif recompute.selective:  # every layer's attention core again
        core_f, _ = attention_core_kernels(shape, b, t, e, config.flash_attention, ring)
        backward = [(dense, list(core_f) + layer_b)]
    else:
        backward = [(dense, layer_b)]
    if moe:
        moe_f, moe_b = layer_kernels(shape, b, t, sp, e, config.flash_attention, ring,
                                     moe_ep=config.ep)
        forward.append((moe, moe_f))
        backward.append((moe, list(core_f) + moe_b))
        if recompute.full and moe_again:  # the checkpointed MoE layers' forward again
            backward.append((moe_again, moe_f))
    if stage.first:
        f, bw = embedding_kernels(shape, b, t, e)
        forward.insert(0, (1, f))
        backward.append((1, bw))
        weight.append((1, bw))  # B stops at the embedding's output: its backward is W
    if stage.last:
        f, bw, w = head_weight_kernels(shape, b, t, sp, e, config.cross_entropy_loss_fusion)
        forward.append((1, f))
        backward.insert(0, (1, bw))
        weight.append((1, w))
    params = stage_parameters(full, config, stage)
    elements = params.numel if config.zero == 0 else min(sharded_numel(params, config),
                                                          params.numel)
    return {"forward": forward, "backward": backward, "weight": weight,
            "optimizer": [(1, [optimizer_kernel(elements, config)])]}
