"""The single-device training loop: it learns, it is deterministic, its ledger is honest."""

import math

import numpy as np
import pytest

from minipar.nn import GPT
from minipar.train import TrainConfig, train
from minipar.train.loop import gpt_config

SMALL = dict(seq_len=16, n_layer=2, d_model=32, n_head=4, micro_batch_size=4)


def test_loss_starts_near_ln_vocab_and_falls_on_the_corpus():
    report = train(TrainConfig(steps=30, lr=3e-3, warmup_steps=3, **SMALL))
    vocab = report.config["vocab_size"]
    assert abs(report.losses[0] - math.log(vocab)) < 0.3
    assert np.mean(report.losses[-5:]) < report.losses[0] - 0.7


def test_same_seed_gives_bit_identical_losses():
    config = TrainConfig(steps=4, precision="fp64", **SMALL)
    assert train(config).losses == train(config).losses


def test_different_seed_gives_different_losses():
    config = TrainConfig(steps=2, precision="fp64", **SMALL)
    assert train(config).losses != train(config.replace(seed=1)).losses


def test_accumulation_matches_one_big_micro_batch_in_fp64():
    """Two micro-batches of 2 accumulate to the gradient of one batch of 4."""
    big = train(TrainConfig(steps=3, precision="fp64", **{**SMALL, "micro_batch_size": 4}))
    accumulated = train(TrainConfig(steps=3, precision="fp64", grad_accum_steps=2,
                                    **{**SMALL, "micro_batch_size": 2}))
    np.testing.assert_allclose(accumulated.losses, big.losses, rtol=1e-12)
    for name, value in big.state_dict.items():
        np.testing.assert_allclose(accumulated.state_dict[name], value, rtol=1e-9, atol=1e-12)


def test_final_weights_differ_from_initial_weights():
    config = TrainConfig(steps=2, precision="fp64", **SMALL)
    report = train(config)
    initial = GPT(gpt_config(config, report.config["vocab_size"]), seed=0,
                  precision="fp64").state_dict()
    assert set(initial) == set(report.state_dict)
    assert any(not np.array_equal(initial[k], report.state_dict[k]) for k in initial)


def test_memory_categories_are_measured():
    report = train(TrainConfig(steps=2, **SMALL))
    memory = report.ranks[0]["memory"]
    params = sum(a.nbytes for a in report.state_dict.values())
    assert memory["params"] == params          # fp32: 4 bytes per parameter
    assert memory["grads"] == params           # one gradient per parameter, same dtype
    assert memory["optimizer"] == 2 * params   # AdamW m and v in fp32
    assert memory["activations"] > 0
    assert memory["peak_total"] <= sum(memory[k] for k in
                                       ("params", "grads", "optimizer", "activations", "buffers"))
    assert memory["peak_total"] >= memory["params"] + memory["optimizer"]


def test_bf16_mixed_holds_two_two_twelve_bytes_per_parameter():
    report = train(TrainConfig(steps=1, precision="bf16-mixed", **SMALL))
    memory, n = report.ranks[0]["memory"], report.n_params
    assert (memory["params"], memory["grads"], memory["optimizer"]) == (2 * n, 2 * n, 12 * n)


def test_activation_checkpointing_lowers_the_activation_peak_and_adds_flops():
    plain = train(TrainConfig(steps=1, **SMALL))
    ckpt = train(TrainConfig(steps=1, activation_checkpointing=True, **SMALL))
    assert ckpt.ranks[0]["memory"]["activations"] < plain.ranks[0]["memory"]["activations"]
    assert ckpt.ranks[0]["time"]["compute_s"] > plain.ranks[0]["time"]["compute_s"]
    np.testing.assert_allclose(ckpt.losses, plain.losses, rtol=1e-5)


def test_a_run_shorter_than_the_warmup_warms_up_over_its_steps():
    report = train(TrainConfig(steps=1, warmup_steps=5, **SMALL))
    assert report.steps[0]["lr"] == pytest.approx(report.config["lr"])


def test_data_parallel_ranks_report_their_mesh_coordinates():
    report = train(TrainConfig(steps=2, dp=4, gpus_per_node=2, precision="fp64", **SMALL))
    assert report.world_size == 4 and len(report.ranks) == 4
    assert [r["coords"] for r in report.ranks] == [{"dp": i, "pp": 0, "tp": 0}
                                                   for i in range(4)]
    assert [r["node"] for r in report.ranks] == [0, 0, 1, 1]
    assert report.config["global_batch_size"] == 4 * SMALL["micro_batch_size"]


def test_data_parallel_trains_like_one_device_with_the_same_global_batch():
    """dp=4 x micro 2 sees the same 8 sequences per step as one device with 4 micro-
    batches of 2: same losses and weights up to fp64 rounding."""
    config = TrainConfig(steps=3, precision="fp64", **{**SMALL, "micro_batch_size": 2})
    parallel = train(config.replace(dp=4))
    single = train(config.replace(grad_accum_steps=4))
    np.testing.assert_allclose(parallel.losses, single.losses, rtol=1e-12)
    for name, value in single.state_dict.items():
        np.testing.assert_allclose(parallel.state_dict[name], value, rtol=1e-9, atol=1e-12)


def test_tensor_and_pipeline_parallelism_are_refused_clearly():
    for setting in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(NotImplementedError, match="--tp 1 --pp 1"):
            train(TrainConfig(steps=1, **setting, **SMALL))
