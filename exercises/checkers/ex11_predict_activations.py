"""Checker of exercise 11: `layer_activation_bytes(config)` and
`activation_peak(config, rank, terms)`, in core mode.

Core mode: the checker supplies minipar's own terms (`ActivationTerms`: the LayerNorms'
fp32 statistics, the embedding's token ids, the head's softmax and targets), taken from
the planner's shapes (`minipar.plan.shapes.ModelShape`), and the student predicts the
textbook part. Both are compared with measurements, not with a formula:
- one layer: minipar trains the configuration with n_layer = 2 and 3; the difference of
  the measured activation peaks is what one layer keeps (fp32, bf16, TP, TP + SP, a
  larger micro-batch and sequence);
- the peak: every rank's measured "activations" peak (DP, TP, TP + SP, a 1F1B pipeline
  whose first stage holds p micro-batches, full recomputation).
A wrong layer is named by its difference (the probabilities, a term not split by t,
sequence parallelism's stream, the GELU's output), a wrong peak by its ratio (micro-batches
in flight under 1F1B, layers kept under recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.plan.shapes import from_train_config
from minipar.train import TrainConfig, train

from .harness import CheckFailed, expect, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "11", "predict the activation bytes (core mode)"
BUILDING_BLOCKS = "predicts without running minipar or its planner"


@dataclass(frozen=True)
class ActivationTerms:
    """minipar's own terms, bytes per micro-batch: both LayerNorms' 1/std in one layer,
    the embedding's token ids, the head (final norm, logits' softmax, targets)."""

    norm_statistics: int
    embedding: int
    head: int


FUNCTIONS = ("layer_activation_bytes", "activation_peak")
CLASSES = (TrainConfig, ActivationTerms)
FORBIDDEN = {"minipar.plan": "the planner is an answer key; predict from the paper",
             "minipar.train": "predict without running: the checker trains and compares",
             "train": "predict without running: the checker trains and compares",
             "launch": "predict without running: the checker trains and compares"}
# T = 12 and 20 (not a multiple of d / a): no two terms of a layer have the same size, so
# a missing one is named by its bytes
MODEL = dict(data="synthetic", vocab_size=32, seq_len=12, n_layer=2, n_head=2, d_model=16,
             micro_batch_size=2, steps=1, bucket_size_mb=0.0, precision="fp32")
LAYER_CASES = (dict(), dict(precision="bf16-mixed", dp=2), dict(tp=2),
               dict(tp=2, sequence_parallel=True), dict(micro_batch_size=4, seq_len=20))
PEAK_CASES = (dict(), dict(dp=2, precision="bf16-mixed"), dict(tp=2, n_layer=3),
              dict(tp=2, sequence_parallel=True),
              dict(pp=2, grad_accum_steps=4, n_layer=4),
              dict(pp=4, grad_accum_steps=2, n_layer=4),
              dict(recompute_granularity="full", n_layer=3),
              dict(recompute_granularity="full", n_layer=2, tp=2, sequence_parallel=True))
BYTES = {"fp64": (8, 8), "fp32": (4, 4), "bf16-mixed": (2, 4)}  # (activation, statistics)


def config_of(values: dict) -> TrainConfig:
    return TrainConfig(**{**MODEL, **values})


def terms_of(config: TrainConfig) -> ActivationTerms:
    """minipar's own terms, from the planner's shape of the config (minipar.plan.shapes)."""
    shape = from_train_config(config)
    a, c = BYTES[config.precision]
    b, t, sp = config.micro_batch_size, config.tp, config.sequence_parallel
    stream = b * config.seq_len // (t if sp else 1)
    return ActivationTerms(norm_statistics=2 * stream * c,
                           embedding=shape.embedding_activation_bytes(b, t),
                           head=shape.head_activation_bytes(b, t, sp, a, c))


def measured(config: TrainConfig) -> list[int]:
    return [r["memory"]["activations"] for r in train(config).ranks]


def describe(c: TrainConfig) -> str:
    parts = [f"{k}={getattr(c, k)}" for k in ("dp", "tp", "pp") if getattr(c, k) > 1]
    if c.sequence_parallel:
        parts.append("sp")
    if c.pp > 1:
        parts.append(f"m={c.grad_accum_steps}")
    if c.recompute_granularity:
        parts.append(f"recompute {c.recompute_granularity}")
    return (f"{' '.join(parts) or 'one rank'}, {c.precision}, B={c.micro_batch_size} "
            f"T={c.seq_len} d={c.d_model} a={c.n_head} L={c.n_layer}")


# ------------------------------------------------------------------ the checks
def check_measurements() -> dict:
    layers = []
    for values in LAYER_CASES:
        config = config_of(values)
        two, three = measured(config), measured(config.replace(n_layer=3))
        layers.append((config, three[0] - two[0]))
    peaks = [(config, measured(config)) for config in map(config_of, PEAK_CASES)]
    return {"layers": layers, "peaks": peaks}


def _layer_hint(config: TrainConfig, got: int, expected: int) -> str:
    a = BYTES[config.precision][0]
    b, s, d, t, heads = (config.micro_batch_size, config.seq_len, config.d_model, config.tp,
                         config.n_head)
    tokens = b * s
    stream = tokens // t if config.sequence_parallel else tokens
    missing = expected - got
    named = {b * heads // t * s * s * a: "the attention probabilities, B (a/t) T T",
             8 * tokens * d // t * a: "the GELU's input and output, 2 x 4 B T d / t",
             4 * tokens * d // t * a: "one of the GELU's input and output (4 B T d / t)",
             3 * tokens * d // t * a: "Q, K and V (3 B T d / t)",
             tokens * d // t * a: "the output projection's input (B T d / t)",
             2 * stream * d * a: "two of the stream's four B T d tensors",
             4 * stream * d * a: "the stream's four B T d tensors (norm inputs, QKV and "
                                 "MLP-in inputs)"}
    if t > 1 and config.sequence_parallel and -missing == 4 * (tokens - stream) * d * a:
        return (" (with sequence parallelism the stream's four tensors hold T/t tokens: "
                "divide them by t too)")
    if missing in named:
        return f" (missing {named[missing]}?)"
    if -missing in named:
        return f" (counted {named[-missing]} once too often?)"
    if t > 1:
        split = (12 * tokens * d // t + b * heads // t * s * s) * a
        if -missing == split * (t - 1):
            return " (the split tensors, Q K V, probabilities, MLP, are 1/t per rank)"
    return ""


def _bytes(got, call: str) -> int:
    """A count of bytes: an int (a NumPy integer too), never a float or an array."""
    if not isinstance(got, (int, np.integer)) or isinstance(got, (bool, np.bool_)):
        raise CheckFailed(f"{call} returned {type(got).__name__} {got!r:.60}; return an int "
                          "(bytes)")
    got = int(got)
    expect(0 <= got < 2 ** 63, f"{call} returned " + (
        f"{got}" if abs(got) < 10 ** 30 else f"an integer of {got.bit_length()} bits")
        + "; a count of bytes is from 0 to 2^63 - 1")
    return got


def check_layers(impl, runs: dict) -> None:
    for config, layer in runs["layers"]:
        expected = layer - terms_of(config).norm_statistics
        got = _bytes(impl.layer_activation_bytes(config), "layer_activation_bytes")
        if got != expected:
            raise CheckFailed(
                f"{describe(config)}: layer_activation_bytes = {got}; one layer measured "
                f"{layer} bytes (the activation peak with 3 layers minus with 2), of which "
                f"{layer - expected} are the LayerNorms' fp32 statistics: {expected} are "
                f"yours{_layer_hint(config, got, expected)}")


def _peak_hint(config: TrainConfig, rank: int, got: int, expected: int,
               terms: ActivationTerms, impl) -> str:
    layer = impl.layer_activation_bytes(config) if config.pp > 1 else None
    if isinstance(layer, (int, np.integer)):
        stage = (rank // config.tp) % config.pp
        k = min(config.pp - stage, config.grad_accum_steps)
        layers = config.n_layer // config.pp + (stage < config.n_layer % config.pp)
        per = layers * (int(layer) + terms.norm_statistics) + (
            terms.embedding if stage == 0 else 0)
        head = terms.head if stage == config.pp - 1 else 0
        for held, why in ((1, "one micro-batch: 1F1B's first stage holds p of them"),
                          (config.grad_accum_steps, "all m micro-batches: that is GPipe")):
            if held != k and got == held * per + head:
                return (f" (stage {stage} counted {why}; under 1F1B stage s holds "
                        f"min(p - s, m) = {k}: the first stage holds p micro-batches of L/p "
                        "layers, one micro-batch of the whole model: PP does not cut the "
                        "first stage's activations)")
    if config.recompute_granularity == "full" and got > expected:
        return (" (with full recomputation a layer keeps only its input until its backward "
                "recomputes it: one whole layer at a time)")
    return ""


def check_peaks(impl, runs: dict) -> None:
    problems = []
    for config, ranks in runs["peaks"]:
        terms = terms_of(config)
        for rank, expected in enumerate(ranks):
            got = _bytes(impl.activation_peak(config, rank, terms), "activation_peak")
            if got != expected:
                problems.append(f"{describe(config)}, rank {rank}: predicted {got}, measured "
                                f"{expected}{_peak_hint(config, rank, got, expected, terms, impl)}")
                break  # one rank per configuration
    if problems:
        raise CheckFailed("\n".join(problems[:4] + ([f"... and {len(problems) - 4} more"]
                                                    if len(problems) > 4 else [])))


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    runs = report.run(f"minipar trains {2 * len(LAYER_CASES) + len(PEAK_CASES)} "
                      "configurations (measurements)", check_measurements)
    checks = [("one layer's saved bytes = measured (L=3 minus L=2, less minipar's norm "
               "statistics): fp32, bf16, TP, TP+SP, larger B and T", check_layers),
              ("every rank's activation peak = measured: DP, TP, SP, 1F1B (p = 2, 4), "
               "full recomputation", check_peaks)]
    for name, fn in checks:
        if runs is None:
            report.skip(name, "needs the measurements")
        else:
            report.run(name, fn, impl, runs)
    return report
