"""Expert parallelism against one device in fp64, and what it costs, measured: expert
bytes per rank, all-to-all bytes per MoE layer and micro-batch against the formula, the
all-to-all inside a node against across nodes, and the mixes that are refused."""

from __future__ import annotations

import math

import pytest

from minipar.errors import ConfigError
from minipar.parallel.expert import dispatch as expert
from minipar.train import TrainConfig, train

# 2 MoE layers of 4 experts, d_model 16, 8-token sequences, 2 sequences per micro-batch
SMALL = dict(seq_len=8, n_layer=2, n_head=2, d_model=16, micro_batch_size=2, steps=2,
             moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.0, precision="fp64")


def _run(**settings):
    return train(TrainConfig(**{**SMALL, **settings}))


@pytest.mark.parametrize("settings", [
    dict(dp=2, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2),
    dict(dp=4, ep=2, zero=1), dict(dp=4, ep=4, zero=1, grad_accum_steps=2),
    dict(dp=4, ep=2, moe_layer_freq=2, moe_top_k=1, moe_capacity_factor=0.5, grad_clip=0.05),
])
def test_expert_parallel_training_equals_one_device(settings):
    report = _run(check=True, **settings)
    assert report.equivalence["passed"], report.equivalence.get("first_mismatch")
    assert report.equivalence["max_rel_param_diff"] < 1e-10


def test_the_check_catches_a_wrong_expert_gradient_scale(monkeypatch):
    # Without Megatron's edp/dp scaling the experts would step ep times too far.
    original = expert.AllToAll.apply
    monkeypatch.setattr(expert.AllToAll, "apply",
                        lambda x, group, scale: original(x, group, 1.0))
    report = _run(dp=2, ep=2, check=True)
    assert not report.equivalence["passed"]


def _expert_bytes_full():
    d = SMALL["d_model"]
    one_expert = (d * 4 * d + 4 * d + 4 * d * d + d) * 8     # c_fc + c_proj, fp64
    return SMALL["n_layer"] * SMALL["moe_num_experts"] * one_expert


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_each_rank_holds_one_ep_th_of_the_expert_bytes(ep):
    report = _run(dp=4, ep=ep, steps=1)
    assert report.moe["expert_param_bytes"] == [_expert_bytes_full() // ep] * 4
    # the ledger agrees: params held per rank fall by the experts given away
    dense = _run(dp=4, ep=1, steps=1).ranks[0]["memory"]["params"]
    held = report.ranks[0]["memory"]["params"]
    assert dense - held == _expert_bytes_full() - _expert_bytes_full() // ep


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_are_four_per_moe_layer_and_micro_batch(ep):
    steps, accum = 2, 2
    report = _run(dp=4, ep=ep, steps=steps, grad_accum_steps=accum)
    tokens = SMALL["micro_batch_size"] * SMALL["seq_len"]
    capacity = math.ceil(tokens * SMALL["moe_top_k"] / SMALL["moe_num_experts"]
                         * SMALL["moe_capacity_factor"])
    buffer = SMALL["moe_num_experts"] * capacity * SMALL["d_model"] * 8   # (E, C, d) fp64
    per_call = (ep - 1) * buffer // ep   # every chunk but my own
    expected = 4 * SMALL["n_layer"] * accum * steps * per_call
    assert report.moe["all_to_all_sent_bytes"] == [expected] * 4
    for rank in report.ranks:
        assert rank["comm"]["by_op"]["all_to_all"] == expected
        # the ep group also carries the gradient norm's 8-byte all-reduces
        assert 0 <= rank["comm"]["by_group"]["ep"] - expected <= 64


def test_load_imbalance_is_counted_and_capacity_factor_drops_tokens():
    tight = _run(dp=2, ep=2, moe_capacity_factor=0.5, steps=1).moe
    loose = _run(dp=2, ep=2, moe_capacity_factor=4.0, steps=1).moe
    tokens = 2 * SMALL["micro_batch_size"] * SMALL["seq_len"]     # both dp ranks, 1 step
    for layer in tight["layers"] + loose["layers"]:
        assert sum(layer["tokens_per_expert"]) == layer["assigned"] == tokens * 2
    # factor 0.5: at most half the assignments fit; factor E / k = 2 or more: none dropped
    assert all(layer["dropped"] >= tokens for layer in tight["layers"])
    assert all(layer["dropped"] == 0 for layer in loose["layers"])


def _all_to_all_seconds(report):
    return sum(r["time"].get("comm_s", 0) for r in report.ranks)


def test_all_to_all_across_nodes_is_slower_than_inside_a_node():
    inside = _run(dp=4, ep=4, steps=1, gpus_per_node=4)
    across = _run(dp=4, ep=4, steps=1, gpus_per_node=1)
    assert _all_to_all_seconds(across) > 2 * _all_to_all_seconds(inside)


@pytest.mark.parametrize("settings, flag", [
    (dict(dp=2, ep=4), "ep"), (dict(dp=3, ep=2), "ep"),
    (dict(dp=2, ep=2, moe_num_experts=3, moe_top_k=1), "ep"),
    (dict(dp=2, ep=2, moe_num_experts=0), "ep"),
    (dict(moe_top_k=5), "moe_top_k"),
])
def test_bad_expert_settings_are_config_errors(settings, flag):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{**SMALL, **settings})
    assert info.value.setting == flag
