"""Recomputation policies (Megatron-LM's --recompute-granularity / -method / -num-layers):
which blocks are checkpointed, what each keeps, what it costs, and that no policy changes
a single number of training, on any layout."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.errors import ConfigError
from minipar.nn import GPT, GPTConfig, Recompute
from minipar.nn.recompute import recompute_problem
from minipar.train import TrainConfig, train

CONFIG = GPTConfig(vocab_size=40, seq_len=16, n_layer=4, n_head=4, d_model=32)
B = 3


def batch(config=CONFIG):
    rng = np.random.default_rng(0)
    return (rng.integers(0, config.vocab_size, (B, config.seq_len)),
            rng.integers(0, config.vocab_size, (B, config.seq_len)))


# ------------------------------------------------------------------ which blocks
def test_uniform_groups_k_consecutive_blocks_into_one_checkpoint():
    assert Recompute("full", "uniform", 2).segments(5) == [(0, 2, True), (2, 4, True),
                                                           (4, 5, True)]
    assert Recompute("full", "uniform", 1).segments(3) == [(0, 1, True), (1, 2, True),
                                                           (2, 3, True)]


def test_block_checkpoints_only_the_first_k_blocks_of_a_chunk():
    assert Recompute("full", "block", 2).segments(4) == [(0, 1, True), (1, 2, True),
                                                         (2, 3, False), (3, 4, False)]
    assert Recompute("full", "block", 2).recomputed_layers(4) == 2
    assert Recompute("full", "uniform", 3).recomputed_layers(4) == 4


def test_activation_checkpointing_and_full_alone_mean_every_block():
    every = Recompute("full", "uniform", 1)
    assert Recompute.from_settings(activation_checkpointing=True) == every
    assert Recompute.from_settings(granularity="full") == every
    assert TrainConfig(recompute_granularity="full").recompute == every
    assert Recompute.from_settings().granularity is None


@pytest.mark.parametrize("flags, setting", [
    (dict(num_layers=2), "recompute_num_layers"),
    (dict(method="block"), "recompute_method"),
    (dict(granularity="selective", num_layers=1), "recompute_num_layers"),
    (dict(granularity="full", method="block"), "recompute_num_layers"),
    (dict(granularity="full", num_layers=1), "recompute_method"),
    (dict(granularity="full", method="block", num_layers=0), "recompute_num_layers"),
    (dict(granularity="full", method="block", num_layers=3), "recompute_num_layers"),
    (dict(granularity="full", method="zigzag", num_layers=1), "recompute_method"),
    (dict(granularity="everything"), "recompute_granularity"),
    (dict(activation_checkpointing=True, granularity="selective"), "recompute_granularity"),
])
def test_inconsistent_flags_are_refused_naming_the_flag(flags, setting):
    values = dict(activation_checkpointing=False, granularity=None, method=None,
                  num_layers=None)
    values.update(flags)
    problem = recompute_problem(values["activation_checkpointing"], values["granularity"],
                                values["method"], values["num_layers"], layers_per_chunk=2)
    assert problem is not None and problem[0] == setting


def test_train_config_refuses_more_layers_than_a_pipeline_chunk_holds():
    with pytest.raises(ConfigError, match="--recompute-num-layers: 3 layers but a pipeline "
                                          "chunk holds at most 2"):
        TrainConfig(n_layer=4, pp=2, recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=3)
    TrainConfig(n_layer=4, pp=2, recompute_granularity="full", recompute_method="block",
                recompute_num_layers=2)  # accepted


# ------------------------------------------------------------------ what each keeps
def saved_after_forward(recompute, config=CONFIG):
    """Activation bytes a forward keeps for backward, the gradients, and the FLOPs
    run again in backward (measured by a virtual device)."""
    idx, targets = batch(config)

    def program():
        model = GPT(config, seed=0, recompute=recompute)
        loss = model(idx, targets)
        saved = dist.get_device().memory.current["activations"]
        loss.backward()
        return saved, {n: p.grad.copy() for n, p in model.named_parameters()}

    (result,), (device,) = dist.launch(program, 1, return_devices=True)
    return result[0], result[1], device.recompute_flops


def test_selective_drops_exactly_the_attention_probabilities_of_every_layer():
    """Korthikanti's 5as^2b term: minipar's fused attention keeps the (b, a, s, s)
    probabilities (no dropout copy), and selective recomputation keeps none of them."""
    plain, grads, _ = saved_after_forward(Recompute())
    selective, selective_grads, flops = saved_after_forward(Recompute("selective"))
    s, a = CONFIG.seq_len, CONFIG.n_head
    probabilities = B * a * s * s * 8  # fp64
    assert plain - selective == CONFIG.n_layer * probabilities
    for name in grads:  # recomputation changes no arithmetic
        assert np.array_equal(selective_grads[name], grads[name]), name
    # the attention core again: q k^T and p v (2 x 2 b a s^2 hd) and the softmax (5 per score)
    scores = B * a * s * s
    assert flops == CONFIG.n_layer * (4 * scores * CONFIG.head_dim + 5 * scores)


def test_block_keeps_the_input_of_its_first_k_blocks_and_everything_of_the_rest():
    plain, grads, _ = saved_after_forward(Recompute())
    every, _, every_flops = saved_after_forward(Recompute("full", "uniform", 1))
    layer_input = B * CONFIG.seq_len * CONFIG.d_model * 8
    per_layer = (plain - every) // CONFIG.n_layer + layer_input  # a whole layer's bytes
    for k in range(1, CONFIG.n_layer + 1):
        saved, block_grads, flops = saved_after_forward(Recompute("full", "block", k))
        assert saved == plain - k * (per_layer - layer_input), k
        assert flops == every_flops * k / CONFIG.n_layer, k
        for name in grads:
            assert np.array_equal(block_grads[name], grads[name]), (k, name)


def test_uniform_keeps_one_input_per_group():
    every, _, _ = saved_after_forward(Recompute("full", "uniform", 1))
    layer_input = B * CONFIG.seq_len * CONFIG.d_model * 8
    pairs, _, _ = saved_after_forward(Recompute("full", "uniform", 2))
    assert every - pairs == 2 * layer_input  # 4 inputs kept -> 2


# ------------------------------------------------------------------ every layout
TINY = dict(n_layer=4, d_model=32, n_head=4, seq_len=16, steps=2, precision="fp64",
            micro_batch_size=2, data="synthetic")
LAYOUTS = {
    "single": dict(grad_accum_steps=2),
    "tp2 sp": dict(tp=2, sequence_parallel=True),
    "pp2 gpipe": dict(pp=2, schedule="gpipe", grad_accum_steps=4),
    "pp2 1f1b": dict(pp=2, grad_accum_steps=4),
    "pp2 interleaved": dict(pp=2, schedule="interleaved", virtual_stages=2,
                            grad_accum_steps=4),
    "dp2 zero1": dict(dp=2, zero=1),
    "dp2 zero3 tp2": dict(dp=2, zero=3, tp=2),
}
POLICIES = {
    "selective": dict(recompute_granularity="selective"),
    "block 1": dict(recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=1),
    "uniform 2": dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_policy_trains_bit_for_bit_like_no_recomputation_and_matches_one_device(
        layout):
    """Recomputation runs the same ops on the same inputs, so on any layout it gives the
    very same losses and weights as keeping everything, and so agrees with one device as
    that layout does (fp64, ~1e-13)."""
    settings = {**TINY, **LAYOUTS[layout]}
    if settings.get("pp", 1) * settings.get("virtual_stages", 1) == 4:
        policies = {k: v for k, v in POLICIES.items() if k != "uniform 2"}  # 1 layer/chunk
    else:
        policies = POLICIES
    plain = train(TrainConfig(**settings))
    for name, policy in policies.items():
        report = train(TrainConfig(**settings, **policy, check=True))
        assert report.equivalence["passed"], (layout, name)
        assert report.equivalence["max_rel_param_diff"] <= 1e-12, (layout, name)
        assert [s["loss"] for s in report.steps] == [s["loss"] for s in plain.steps]
        for key, value in plain.state_dict.items():
            assert np.array_equal(report.state_dict[key], value), (layout, name, key)
        assert all(r["recompute_flops"] > 0 for r in report.ranks), (layout, name)
    assert all(r["recompute_flops"] == 0 for r in plain.ranks)


@pytest.mark.parametrize("args", [("full",), ("full", "block"), ("selective", "block", 1),
                                  ("full", "block", 0), ("partial",)])
def test_a_policy_built_by_hand_is_checked_too(args):
    with pytest.raises(ConfigError, match="^--recompute-"):
        Recompute(*args)
