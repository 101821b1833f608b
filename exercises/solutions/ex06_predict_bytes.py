"""Reference solution of exercise 06: predict per-rank bytes of a DP x PP x TP / ZeRO run."""

from __future__ import annotations

from minipar import distributed as dist

# Bytes per parameter element: (parameters and activations, gradients, optimizer state).
# bf16-mixed: bf16 params and grads, fp32 master + m + v (ZeRO paper, section 3: K = 12).
BYTES = {"fp64": (8, 8, 16), "fp32": (4, 4, 8), "bf16-mixed": (2, 2, 12)}


def count_parameters(config) -> int:
    d, vocab, seq = config.d_model, config.vocab_size, config.seq_len
    block = (2 * 2 * d  # ln_1, ln_2
             + d * 3 * d + 3 * d  # c_attn
             + d * d + d  # attn.c_proj
             + d * 4 * d + 4 * d  # c_fc
             + 4 * d * d + d)  # mlp.c_proj: 12 d^2 + 13 d in all
    head = 0 if config.tie_embeddings else vocab * d
    return vocab * d + seq * d + config.n_layer * block + 2 * d + head


def _stage_layers(config, stage: int) -> int:
    """Blocks on pipeline stage `stage`: n_layer // p each, the first n_layer % p one more."""
    base, extra = divmod(config.n_layer, config.pp)
    return base + (stage < extra)


def _local_parameters(config, stage: int = 0) -> int:
    """Parameters one rank of pipeline stage `stage` holds: its blocks, wte and wpe on the
    first stage, ln_f and the head on the last (a tied head keeps its own copy of wte);
    under TP the split ones / t, plus the replicated ones."""
    d, vocab, layers = config.d_model, config.vocab_size, _stage_layers(config, stage)
    first, last = stage == 0, stage == config.pp - 1
    split = layers * (12 * d * d + 7 * d)  # matrices, c_attn/c_fc biases
    replicated = layers * 6 * d  # LNs, c_proj biases
    if first:
        split += vocab * d  # wte rows
        replicated += config.seq_len * d  # wpe
    if last:
        replicated += 2 * d  # ln_f
        if not config.tie_embeddings or not first:  # lm_head, or the last stage's wte copy
            split += vocab * d
    return split // config.tp + replicated


def _all_reduce(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n


def _ring_part(nbytes: int, n: int) -> int:
    return (n - 1) * nbytes // n


def predict_rank(config, rank: int) -> dict[str, int]:
    n, t, p, zero = config.dp, config.tp, config.pp, config.zero
    accum, steps = config.grad_accum_steps, config.steps
    tp_rank, stage, dp_rank = rank % t, (rank // t) % p, rank // (t * p)
    psi = _local_parameters(config, stage)
    param_bytes, grad_bytes, optimizer_bytes = BYTES[config.precision]
    out = {
        "params": psi * param_bytes // (n if zero >= 3 else 1),
        "grads": psi * grad_bytes // (n if zero >= 2 else 1),
        "optimizer": psi * optimizer_bytes // (n if zero >= 1 else 1),
        "dp": 0, "tp": 0, "pp": 0,
    }
    norm = dist.all_reduce_bytes  # of the one-float64 squared gradient norm

    if n > 1:
        size = psi * param_bytes  # S of the flat gradients and of the flat parameters
        if zero == 0:
            out["dp"] = steps * _all_reduce(size, n)
        else:
            out["dp"] = steps * norm(1, 8, n, dp_rank)[0]
            if zero == 1:
                out["dp"] += steps * 2 * _ring_part(size, n)
            elif zero == 2:
                out["dp"] += steps * (accum + 1) * _ring_part(size, n)
            else:
                # every unit twice per micro-batch; with tied embeddings the embed unit once
                # more, for the head's forward
                embed = (config.vocab_size // t + config.seq_len) * config.d_model
                gathered = 2 * size + (embed * param_bytes if config.tie_embeddings else 0)
                out["dp"] += steps * accum * (_ring_part(size, n) + _ring_part(gathered, n))

    tokens = config.micro_batch_size * config.seq_len
    activation = tokens * config.d_model * param_bytes  # one (B, T, d) activation
    if t > 1:  # (the configurations do not combine TP with PP)
        per_micro_batch = ((1 + 2 * config.n_layer) * _all_reduce(activation, t)  # forward
                           + (2 * config.n_layer + 1) * _all_reduce(activation, t)  # backward
                           + _all_reduce(tokens * param_bytes, t)  # cross-entropy: max
                           + _all_reduce(2 * tokens * param_bytes, t))  # and the two sums
        out["tp"] = steps * (accum * per_micro_batch + norm(1, 8, t, tp_rank)[0])

    if p > 1:
        # per micro-batch: the output activation forward (all but the last stage) and the
        # gradient of the input backward (all but the first), each (B, T, d)
        sends = (stage < p - 1) + (stage > 0)
        out["pp"] = steps * (accum * sends * activation
                             + norm(1, 8, p, stage)[0]  # the gradient norm over the stages
                             + (8 if stage == p - 1 else 0))  # the loss, broadcast by the last
        if config.tie_embeddings and stage in (0, p - 1):
            # Megatron's embedding group {first, last}: all-reduce of the wte gradient
            out["pp"] += steps * _all_reduce(config.vocab_size // t * config.d_model
                                             * grad_bytes, 2)
    return out
