"""ModelShape: parameter counts against published figures, FLOPs against Narayanan et al.
2021 and Kaplan et al. 2020, activations against Korthikanti et al. 2022."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minipar.nn import GPTConfig
from minipar.nn.gpt import parameter_shapes
from minipar.plan import presets
from minipar.plan.shapes import ModelShape, from_train_config
from minipar.train import TrainConfig

# Published parameter counts. GPT-2: the Hugging Face checkpoints (tied head). BLOOM: the
# model card's exact count. Llama-2: Touvron et al. 2023 ("6.74B", "13.0B", "69.0B" in
# the released model cards / Table 1 rounding). GPT-3: Brown et al. 2020, "175B".
EXACT = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "bloom-176b": 176_247_271_424,
}
ROUNDED = {  # name: (published, relative tolerance of the rounding)
    "llama2-7b": (6.74e9, 0.001),
    "llama2-13b": (13.0e9, 0.005),
    "llama2-70b": (69.0e9, 0.002),
    "gpt3-175b": (175e9, 0.003),
    # Llama 3 and Mistral: the Hugging Face model cards' counts ("8.03B", "70.6B", "406B",
    # "7.24B": the released safetensors)
    "llama3-8b": (8.03e9, 0.001),
    "llama3-70b": (70.6e9, 0.001),
    "llama3-405b": (406e9, 0.001),
    "mistral-7b": (7.24e9, 0.001),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_published_parameter_counts(name):
    assert presets.model(name).n_params == EXACT[name]


@pytest.mark.parametrize("name", sorted(ROUNDED))
def test_rounded_published_parameter_counts(name):
    published, tolerance = ROUNDED[name]
    assert presets.model(name).n_params == pytest.approx(published, rel=tolerance)


@pytest.mark.parametrize("tie", [True, False])
def test_minipar_shape_counts_the_parameters_minipar_builds(tie):
    config = GPTConfig(vocab_size=65, seq_len=32, n_layer=3, n_head=4, d_model=48,
                       tie_embeddings=tie)
    built = sum(int(np.prod(s)) for s in parameter_shapes(config).values())
    shape = from_train_config(TrainConfig(n_layer=3, n_head=4, d_model=48, seq_len=32,
                                          tie_embeddings=tie), vocab_size=65)
    assert shape.n_params == built


@pytest.mark.parametrize("name", ["gpt2-xl", "llama2-70b", "bloom-176b"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_split_covers_every_parameter(name, tp):
    shape = presets.model(name)
    split, replicated = shape.layer_params(tp)
    full_split, full_replicated = shape.layer_params(1)
    assert split * tp == full_split and replicated == full_replicated
    assert sum(shape.layer_params(1)) == split * tp + replicated


def test_llama2_70b_layer_is_grouped_query_swiglu():
    shape = presets.model("llama2-70b")
    h, f, kv = 8192, 28672, 8 * 128
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o (no biases)
    mlp = 3 * h * f  # gate, up, down
    assert sum(shape.layer_params()) == attention + mlp + 2 * h  # two RMSNorm weights


def test_model_flops_match_narayanan_closed_form_for_a_gpt_shape():
    # Narayanan et al. 2021, eq. 3 without recomputation (72 instead of 96):
    # 72 B s L h^2 (1 + s / 6h + V / 12 L h) per batch of B sequences.
    shape = presets.model("gpt3-175b")
    s, layers, h, vocab = shape.seq_len, shape.n_layer, shape.d_model, shape.vocab_size
    expected = 72 * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert shape.model_flops_per_sequence() == pytest.approx(expected, rel=1e-12)


def test_model_flops_are_six_n_plus_attention_for_llama():
    # Kaplan et al. 2020, section 2.1: 6 N per token for the matmul weights (the input
    # embedding is a lookup, not a matmul, so it is left out) plus 12 L s h for attention.
    shape = presets.model("llama2-7b")
    norms = (2 * shape.n_layer + 1) * shape.d_model
    n_matmul = shape.n_params - shape.vocab_size * shape.d_model - norms
    per_token = 6 * n_matmul + 12 * shape.n_layer * shape.seq_len * shape.d_model
    assert shape.model_flops_per_sequence() / shape.seq_len == pytest.approx(per_token,
                                                                             rel=1e-12)


def test_forward_and_backward_matmuls_are_one_to_two():
    shape = presets.model("gpt3-175b").with_seq_len(2048)
    forward, backward = shape.layer_flops(1)
    assert backward / forward == pytest.approx(2.0, rel=0.01)  # elementwise: < 1% apart


# ------------------------------------------------------------------ activations
def korthikanti(s, b, h, a, t=1, sequence_parallel=False):
    """Korthikanti et al. 2022, eq. 1, 2 and 4: bytes per layer in 16-bit, dropout on."""
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (4, False), (4, True), (8, True)])
def test_layer_activations_follow_korthikanti(t, sp):
    s, b, h, a = 2048, 2, 1024, 16
    shape = ModelShape(n_layer=4, d_model=h, n_head=a, vocab_size=50304, seq_len=s,
                       dropout=0.1)
    ours = shape.layer_activation_bytes(b, t, sp, activation_bytes=2, compute_bytes=4)
    # minipar's fused attention keeps the probabilities and their dropout mask but not
    # the dropped-out copy (2 a s^2 b / t bytes less), and keeps the norms' 1/std in fp32.
    stream = s * b // (t if sp else 1)
    expected = korthikanti(s, b, h, a, t, sp) - 2 * a * s * s * b / t + 2 * stream * 4
    assert ours == pytest.approx(expected, rel=1e-12)


def test_flash_attention_drops_the_quadratic_term():
    shape = ModelShape(n_layer=2, d_model=1024, n_head=16, vocab_size=1000, seq_len=4096)
    plain = shape.layer_activation_bytes(1, 1, False, 2, 4, flash_attention=False)
    flash = shape.layer_activation_bytes(1, 1, False, 2, 4, flash_attention=True)
    s, a = 4096, 16
    assert plain - flash == 2 * a * s * s - a * s * 4  # probabilities out, log-sum-exp in


def test_full_recomputation_keeps_2sbh_per_layer():
    shape = ModelShape(n_layer=2, d_model=512, n_head=8, vocab_size=1000, seq_len=1024)
    assert shape.layer_input_bytes(4, 1, False, 2) == 2 * 1024 * 4 * 512
    assert shape.layer_input_bytes(4, 4, True, 2) == 2 * 1024 * 4 * 512 // 4


def test_bad_shapes_name_the_setting():
    with pytest.raises(ValueError, match="n_head"):
        ModelShape(d_model=64, n_head=5)
    with pytest.raises(ValueError, match="n_kv_head"):
        ModelShape(d_model=64, n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="mlp"):
        ModelShape(mlp="relu")
    # widths that are not positive integers: refused, not divided by or counted
    for width in ({"n_kv_head": 0}, {"n_kv_head": 2.5}, {"d_ff": 0}, {"d_ff": -3}):
        with pytest.raises(ValueError, match=rf"ModelShape\.{next(iter(width))} must be a "
                                             "positive integer"):
            ModelShape(**width)
    assert math.isclose(presets.model("gpt2").head_dim, 64)
