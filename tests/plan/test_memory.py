"""Memory per rank against the ZeRO paper's model-state formulas and Korthikanti et al.
2022's activation accounting (the emulator-backed checks are in test_estimate.py)."""

from __future__ import annotations

import pytest

from minipar.plan import presets
from minipar.plan.layout import ParallelConfig, stage_plans
from minipar.plan.memory import stage_memory, stage_parameters
from minipar.plan.shapes import ModelShape

# Rajbhandari et al. 2020, Figure 1: Psi = 7.5B parameters, N = 64 DP ranks, K = 12.
PSI, N, K = 7.5e9, 64, 12
FIGURE_1 = {0: (2 + 2 + K) * PSI, 1: (2 + 2) * PSI + K * PSI / N,
            2: 2 * PSI + (2 + K) * PSI / N, 3: (2 + 2 + K) * PSI / N}


def model_state(memory):
    return memory["params"] + memory["grads"] + memory["optimizer"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_follows_zero_figure_1(zero):
    shape = presets.model("llama2-7b")  # 6.74B parameters: the figure's regime
    # the paper's 2 + 2 + 12: bf16 gradients (the planner's default is Megatron's fp32)
    config = ParallelConfig(dp=N, zero=zero, precision="bf16-mixed", grad_accum_dtype="bf16")
    (plan,) = stage_plans(shape, config)
    psi = stage_parameters(shape, config, plan).numel
    expected = FIGURE_1[zero] * psi / PSI
    padding = (2 + 2 + K) * N * (len(stage_parameters(shape, config, plan).units))
    assert model_state(stage_memory(shape, config, plan)) == pytest.approx(expected, abs=padding)


def test_figure_1_totals_in_gigabytes():
    # the paper's own numbers for Psi = 7.5B: 120, 31.4, 16.6, 1.9 GB
    assert [round(FIGURE_1[z] / 1e9, 1) for z in range(4)] == [120.0, 31.4, 16.6, 1.9]


def test_zero_shards_are_padded_to_the_dp_size():
    shape = presets.model("gpt2")  # 124,439,808 = 64 x 1,944,372: use N = 7 to pad
    config = ParallelConfig(dp=7, zero=1, precision="fp32")
    (plan,) = stage_plans(shape, config)
    memory = stage_memory(shape, config, plan)
    shard = -(-shape.n_params // 7)
    assert memory["optimizer"] == shard * 8  # m and v in fp32
    assert memory["params"] == shard * 7 * 4  # the padded flat buffer


def test_first_pipeline_stage_holds_one_models_worth_of_activations():
    # Korthikanti et al. 2022, section 4.2.3: with 1F1B the first stage keeps p
    # micro-batches of L/p layers, i.e. L layers' worth, whatever p is.
    shape = presets.model("gpt3-175b")
    layer = shape.layer_activation_bytes(1, 8, True, 2, 4)
    for p in (2, 4, 8):
        config = ParallelConfig(tp=8, pp=p, sequence_parallel=True, grad_accum_steps=32)
        first = stage_plans(shape, config)[0]
        activations = stage_memory(shape, config, first)["activations"]
        layers_part = activations - shape.embedding_activation_bytes(1, 8) * p
        assert layers_part == shape.n_layer * layer


def test_interleaving_multiplies_first_stage_activations_by_korthikanti_factor():
    # section 4.2.3: 1 + (p - 1) / (p v) times one model's layers
    shape = presets.model("gpt3-175b")
    p, v = 8, 2
    layer = shape.layer_activation_bytes(1, 8, True, 2, 4)
    config = ParallelConfig(tp=8, pp=p, schedule="interleaved", virtual_stages=v,
                            sequence_parallel=True, grad_accum_steps=32)
    first = stage_plans(shape, config)[0]
    activations = stage_memory(shape, config, first)["activations"]
    layers = shape.n_layer * layer * (1 + (p - 1) / (p * v))
    # plus the token ids of the micro-batches of chunk 0 in flight: Megatron's order runs
    # forwards p at a time per chunk, so of the 23 warm-up forwards and the first steady
    # one (c0 x 8, c1 x 8, c0 x 8), 16 are chunk 0's, none of them backward yet
    assert activations == layers + 16 * shape.embedding_activation_bytes(1, 8)


def test_full_recomputation_keeps_layer_inputs_and_one_layer():
    shape = presets.model("gpt2-xl")
    config = ParallelConfig(recompute_granularity="full", micro_batch_size=2,
                            precision="bf16-mixed")
    (plan,) = stage_plans(shape, config)
    memory = stage_memory(shape, config, plan)
    inputs = shape.n_layer * shape.layer_input_bytes(2, 1, False, 2)  # 2 s b h L
    working = max(shape.layer_activation_bytes(2, 1, False, 2, 4),
                  shape.head_activation_bytes(2, 1, False, 2, 4))
    assert memory["activations"] == (inputs + working
                                     + shape.embedding_activation_bytes(2, 1))


@pytest.mark.parametrize("zero, per_parameter", [(0, 2 + 4 + K), (1, 2 + 4 + K / N)])
def test_planner_defaults_to_megatrons_fp32_gradient_buffers(zero, per_parameter):
    # bf16 parameters, fp32 main_grad buffers: Megatron-LM's 18 bytes per parameter, or
    # 6 + 12/N with its distributed optimizer (megatron/training/theoretical_memory_usage.py)
    shape = presets.model("llama2-7b")
    config = ParallelConfig(dp=N, zero=zero)
    assert config.precision == "bf16-mixed" and config.grad_dtype == "fp32"
    assert config.bytes.grad == 4 and config.bytes.param == 2
    (plan,) = stage_plans(shape, config)
    psi = stage_parameters(shape, config, plan).numel
    assert model_state(stage_memory(shape, config, plan)) == pytest.approx(
        per_parameter * psi, abs=(2 + 4 + K) * N)
    paper = config.replace(grad_accum_dtype="bf16")
    assert model_state(stage_memory(shape, paper, plan)) == pytest.approx(
        (per_parameter - 2) * psi, abs=(2 + 4 + K) * N)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_rank_of_no_parameters_holds_no_model_state(zero):
    """A layer split may leave a pipeline rank no layer, embedding or head (DualPipe-V
    over three ranks of a two-layer model): it launches no gradient bucket and holds no
    model state, and its stage is planned like the others."""
    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=65, seq_len=64)
    config = ParallelConfig(dp=2, pp=3, zero=zero, schedule="dualpipe-v", virtual_stages=2,
                            layer_split=(0, 0, 0, 1, 0, 1), micro_batch_size=1,
                            global_batch_size=12, bucket_size_mb=0.001)
    empty = stage_plans(shape, config, all_ranks=True)[1]
    assert empty.layers == 0 and not (empty.first or empty.last)
    assert model_state(stage_memory(shape, config, empty)) == 0
