"""Reference solution of exercise 11: predict the activation bytes (core mode)."""

from __future__ import annotations

BYTES = {"fp64": 8, "fp32": 4, "bf16-mixed": 2}  # activations in the parameters' dtype


def _stream_tokens(config) -> int:
    tokens = config.micro_batch_size * config.seq_len
    return tokens // config.tp if config.sequence_parallel else tokens


def layer_activation_bytes(config) -> int:
    b, s, d, t = config.micro_batch_size, config.seq_len, config.d_model, config.tp
    tokens, stream = b * s, _stream_tokens(config)
    elements = (4 * stream * d  # two LayerNorm inputs, QKV and MLP-in inputs
                + 3 * tokens * d // t  # Q, K, V
                + b * config.n_head // t * s * s  # attention probabilities
                + tokens * d // t  # output projection's input
                + 2 * 4 * tokens * d // t)  # GELU input and output
    return elements * BYTES[config.precision]


def activation_peak(config, rank: int, terms) -> int:
    layer = layer_activation_bytes(config) + terms.norm_statistics
    p, t, m = config.pp, config.tp, config.grad_accum_steps
    stage = (rank // t) % p
    base, extra = divmod(config.n_layer, p)
    layers = base + (stage < extra)
    first, last = stage == 0, stage == p - 1
    embedding = terms.embedding if first else 0
    head = terms.head if last else 0
    if config.recompute_granularity == "full":
        inputs = layers * _stream_tokens(config) * config.d_model * BYTES[config.precision]
        return inputs + embedding + max(head, layer)
    in_flight = min(p - stage, m)  # 1F1B: p - s micro-batches on stage s
    return in_flight * (layers * layer + embedding) + head
