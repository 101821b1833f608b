"""Which parameters each module of a rank holds, in registration order, and when its
backward completes each: what plan/buckets.py lays into gradient buckets.

minipar registers a GPT's parameters as Hugging Face GPT-2 names them (docs/design.md): wte,
wpe, then per block ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weights
before biases), then ln_f and an untied lm_head; a pipeline's last stage keeps its own
copy of a tied wte. DDP's buckets follow the reverse of that order (Li et al. 2020,
section 3.2.3), and a parameter's gradient is complete when backward has run the op that
uses it (a post-accumulate-grad hook): `layer_ready` / `head_ready` give that point as a
share of the module's backward.
"""

from __future__ import annotations

from minipar.plan.shapes import (
    ACTIVATION_FLOPS,
    CROSS_ENTROPY_FLOPS,
    NORM_FLOPS,
    SOFTMAX_FLOPS,
    ModelShape,
    padded_vocab,
)


def layer_tensors(shape: ModelShape, tp: int = 1) -> tuple[int, ...]:
    """Elements of a transformer layer's parameters on one TP rank, in minipar's (and
    Hugging Face GPT-2's) registration order: ln_1, attn.c_attn, attn.c_proj, ln_2,
    mlp.c_fc (gate and up with SwiGLU), mlp.c_proj; weights before biases."""
    return tuple(numel for numel, _, _ in _layer_parameters(shape, tp))


def layer_vectors(shape: ModelShape, tp: int = 1) -> tuple[bool, ...] | None:
    """For each of `layer_tensors`, whether sequence parallelism leaves its gradient
    partial over TP (the norms' weights and biases, the row-parallel layers' biases:
    parallel/tensor/sequence.py); None for a layer that list does not know."""
    parameters = _layer_parameters(shape, tp)
    return None if len(parameters) == 1 else tuple(vector for _, vector, _ in parameters)


def column_parallel_weights(shape: ModelShape, tp: int = 1) -> tuple[int, int] | None:
    """Places in `layer_tensors` of the column-parallel weights, attn.c_attn's (QKV)
    and mlp.c_fc's, whose gradients sequence parallelism forms from a re-gathered
    input; None for a layer that list does not know."""
    parameters = _layer_parameters(shape, tp)
    if len(parameters) == 1:
        return None
    qkv, mlp_in = (j for j, (_, _, column) in enumerate(parameters) if column)
    return qkv, mlp_in


def _layer_parameters(shape: ModelShape, tp: int) -> list[tuple[int, bool, bool]]:
    """(elements, sequence-parallel vector?, column-parallel weight?) of each parameter
    of a layer, in order."""
    h = shape.d_model
    norm = [(h, True, False)] * (2 if shape.norm == "layernorm" else 1)
    bias = shape.bias
    parameters = [*norm, (h * shape.qkv_width // tp, False, True)]
    parameters += [(shape.qkv_width // tp, False, False)] if bias else []
    parameters += [(h * h // tp, False, False)] + ([(h, True, False)] if bias else [])
    parameters += [*norm, (h * shape.mlp_in_width // tp, False, True)]
    parameters += [(shape.mlp_in_width // tp, False, False)] if bias else []
    parameters += [(shape.ffn * h // tp, False, False)] + ([(h, True, False)] if bias else [])
    if sum(numel for numel, _, _ in parameters) != sum(shape.layer_params(tp)):
        return [(sum(shape.layer_params(tp)), False, False)]  # a layer this list does not know
    return parameters


COLLECTIVES = "collectives"  # a step of layer_ready's that is TP communication


def layer_ready(shape: ModelShape, b: int, tp: int = 1, sequence_parallel: bool = False,
                comm_share: float = 0.0, recompute_share: float = 0.0,
                weight: bool = False, core_again_flops: float = 0.0) -> tuple[float, ...]:
    """Share of a layer's backward run when each tensor of `layer_tensors` is complete.
    Backward meets the ops in reverse: MLP-out GEMM (its weight and bias), activation,
    MLP-in GEMM, the TP all-reduce of its input gradient (Megatron's f), norm 2,
    attention output GEMM, the attention core (no parameters), QKV GEMM, the second f,
    norm 1; a GEMM's backward costs 4 T x its weight's elements, a bias's sum T x its
    elements after it. comm_share: the part of the layer's backward time in those TP
    collectives (the rest is shared by FLOPs); recompute_share: the part in full
    recomputation's forward again, its collectives too, which runs first;
    core_again_flops: selective recomputation's attention core, which runs where
    backward meets the core. weight:
    the shares of a split backward's W instead, which meets the same ops in the same
    order but runs only the GEMMs' weight gradients, 2 T x each weight's elements (a
    norm's gradients, made in B, are complete when W reaches it), and under sequence
    parallelism gathers QKV's and fc1's inputs again before their dW (comm_share then
    the W's share in those re-gathers)."""
    h, s, tokens = shape.d_model, shape.seq_len, b * shape.seq_len
    stream = tokens // tp if sequence_parallel else tokens
    norm = NORM_FLOPS[shape.norm][1] * stream * h
    scores = b * shape.n_head // tp * s * s
    core = 2 * 4 * scores * shape.head_dim + SOFTMAX_FLOPS[1] * scores
    gemm, other = (2, 0) if weight else (4, 1)  # FLOPs per token and weight; the rest
    # a bias's gradient, the sum of dy over the tokens, comes after its weight's (B and
    # W); a row-parallel layer's under TP before it: it adds its bias after the
    # reduction, an op of its own that backward meets first (parallel/tensor/layers.py)
    bias = 1 if shape.bias else 0

    def row_parallel(flops: float, group: str) -> list:
        gemm_step, bias_step = (flops, group), (bias * stream * h, f"{group} bias")
        return [bias_step, gemm_step] if tp > 1 else [gemm_step, bias_step]

    # The TP collectives, as shares of comm_share, where backward meets them
    # (parallel/tensor/): without sequence parallelism, B's all-reduce of a
    # column-parallel layer's input gradient (f) after its GEMMs; with it, the all-gather
    # of a row-parallel layer's output gradient before its GEMMs, and a column-parallel
    # layer's input gathered again and its input gradient reduce-scattered between its
    # dX and its dW, all alike; W's re-gathers before the dW they feed.
    if weight:
        before_row, before_dw, after_column = [], [(COLLECTIVES, 1 / 2)], []
    elif sequence_parallel:
        before_row, before_dw, after_column = ([(COLLECTIVES, 1 / 6)], [(COLLECTIVES, 1 / 3)],
                                               [])
    else:
        before_row, before_dw, after_column = [], [], [(COLLECTIVES, 1 / 2)]

    def column_parallel(width: int, group: str) -> list:
        dgrad = other * 2 * tokens * h * width / tp  # dX, then dW (after its input)
        return [(dgrad, None), *before_dw, (2 * tokens * h * width / tp, group),
                (bias * tokens * width / tp, f"{group} bias"), *after_column]

    steps = [  # (backward FLOPs, the tensors it completes: layer_tensors' groups)
        *before_row,
        *row_parallel(gemm * tokens * shape.ffn * h / tp, "mlp out"),
        (other * ACTIVATION_FLOPS[shape.mlp][1] * tokens * shape.ffn / tp, None),
        *column_parallel(shape.mlp_in_width, "mlp in"),
        (other * norm, "norm 2"),
        *before_row,
        *row_parallel(gemm * tokens * h * h / tp, "attention out"),
        (other * (core_again_flops + core), None),
        *column_parallel(shape.qkv_width, "qkv"),
        (other * norm, "norm 1"),
    ]
    total = sum(f for f, _ in steps if f is not COLLECTIVES)
    computing = max(0.0, 1 - comm_share - recompute_share)  # the share the FLOPs divide
    done, share = recompute_share, {}
    for flops, group in steps:
        if flops is COLLECTIVES:  # (group: their fraction of comm_share)
            done += comm_share * group
            continue
        done += computing * flops / total
        if group is not None:
            share[group] = done
    norms = 2 if shape.norm == "layernorm" else 1
    groups = ["norm 1"] * norms
    for linear in ("qkv", "attention out", "norm 2", "mlp in", "mlp out"):
        groups += ([linear] * norms if linear == "norm 2"
                   else [linear] + [f"{linear} bias"] * bias)
    if len(groups) != len(layer_tensors(shape, tp)):
        return (1.0,) * len(layer_tensors(shape, tp))
    return tuple(share[g] for g in groups)


def head_ready(shape: ModelShape, b: int, tp: int, tensors: tuple[int, ...],
               comm_share: float = 0.0) -> tuple[float, ...]:
    """Share of the head's backward run when each of `head_tensors` is complete: the
    cross-entropy and the logits GEMM (the LM head's weight, or the tied copy) first,
    then the TP all-reduce of its input gradient (comm_share of the time), the final norm
    last."""
    tokens, h = b * shape.seq_len, shape.d_model
    vocab = padded_vocab(shape.vocab_size, tp) // tp
    logits = CROSS_ENTROPY_FLOPS[1] * tokens * vocab + 4 * tokens * h * vocab
    share = (1 - comm_share) * logits / (logits + NORM_FLOPS[shape.norm][1] * tokens * h)
    norms = 2 if shape.norm == "layernorm" else 1
    return (1.0,) * norms + (share,) * (len(tensors) - norms)


def embedding_tensors(shape: ModelShape, tp: int = 1) -> tuple[int, ...]:
    """wte (vocabulary-parallel), wpe (learned positions), an embedding norm (BLOOM)."""
    tensors = [padded_vocab(shape.vocab_size, tp) // tp * shape.d_model]
    if shape.position == "learned":
        tensors.append(shape.seq_len * shape.d_model)
    if shape.embedding_norm:
        tensors += [shape.d_model] * (2 if shape.norm == "layernorm" else 1)
    return tuple(tensors)


def embedding_late(shape: ModelShape, tp: int, pp: int) -> tuple[bool, ...]:
    """Which of embedding_tensors are reduced only after the flush: a tied wte under
    pipeline parallelism, whose gradient is final once its copies are summed."""
    return ((pp > 1 and shape.tie_embeddings),) + (False,) * (
        len(embedding_tensors(shape, tp)) - 1)


def head_tensors(shape: ModelShape, tp: int = 1, tied_copy: bool = False
                 ) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """ln_f, then the untied LM head or the last stage's copy of a tied wte (late)."""
    h = shape.d_model
    tensors = [h, h] if shape.norm == "layernorm" else [h]
    late = [False] * len(tensors)
    vocab_rows = padded_vocab(shape.vocab_size, tp) // tp * h
    if not shape.tie_embeddings:
        tensors.append(vocab_rows)
        late.append(False)
    elif tied_copy:
        tensors.append(vocab_rows)
        late.append(True)
    return tuple(tensors), tuple(late)
