"""ZeRO-Offload / ZeRO-Infinity (minipar/parallel/zero/offload.py): the same numbers as
without offload, the state in another tier, and the copies that move it."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.errors import ConfigError
from minipar.nn.optim import ADAMW_FLOPS_PER_ELEMENT
from minipar.train import TrainConfig, train

TINY = dict(n_layer=2, d_model=32, n_head=4, seq_len=16, data="synthetic", steps=2,
            micro_batch_size=2)
PROFILE = dist.DeviceProfile()

EXACT_CASES = [
    dict(dp=2, zero=1, offload_optimizer="cpu", grad_accum_steps=2),
    dict(dp=2, zero=2, offload_optimizer="cpu", grad_accum_steps=2),
    dict(dp=2, zero=3, offload_optimizer="cpu", grad_accum_steps=2),
    dict(dp=2, zero=3, offload_optimizer="cpu", offload_param="cpu"),
    dict(dp=2, zero=3, offload_optimizer="nvme", offload_param="nvme", grad_accum_steps=2),
    dict(dp=2, zero=3, offload_param="cpu"),
    dict(dp=2, tp=2, zero=2, offload_optimizer="cpu"),
    dict(dp=2, pp=2, n_layer=4, zero=1, offload_optimizer="cpu", grad_accum_steps=2),
]


@pytest.mark.parametrize("settings", EXACT_CASES,
                         ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
def test_offload_changes_no_arithmetic(settings):
    """fp64: checked against one device every step, and bit-identical to the same
    layout without offload (the same AdamW on the same values, in another tier)."""
    config = TrainConfig(**{**TINY, **settings, "precision": "fp64", "check": True})
    offloaded = train(config)
    assert offloaded.equivalence["passed"]
    assert offloaded.equivalence["max_rel_param_diff"] < 1e-12
    on_gpu = train(config.replace(offload_optimizer="none", offload_param="none",
                                  check=False))
    for name, values in on_gpu.state_dict.items():
        np.testing.assert_array_equal(offloaded.state_dict[name], values, err_msg=name)
    assert [s["loss"] for s in offloaded.steps] == [s["loss"] for s in on_gpu.steps]


def bf16(**settings):
    return train(TrainConfig(**{**TINY, "precision": "bf16-mixed", "dp": 2, **settings}))


def test_the_optimizer_state_moves_from_the_gpu_to_the_host():
    """ZeRO-1 bf16-mixed: the 12 bytes per parameter of my shard (fp32 master, m, v)
    leave the GPU ledger and appear in the host ledger, byte for byte."""
    on_gpu, offloaded = bf16(zero=1), bf16(zero=1, offload_optimizer="cpu")
    for before, after in zip(on_gpu.ranks, offloaded.ranks, strict=True):
        assert after["memory"]["optimizer"] == 0
        assert after["memory_host"]["optimizer"] == before["memory"]["optimizer"] > 0
        assert after["memory"]["params"] == before["memory"]["params"]
        assert after["memory_nvme"]["peak_total"] == 0
        assert after["memory"]["peak_total"] < before["memory"]["peak_total"]


def test_zero1_sends_fp32_gradients_down_and_fp32_parameters_up_once_per_step():
    """DeepSpeed's stage_1_and_2.py: `.float()` on the GPU before the copy down,
    `fp32_partition.to(device)` before the cast up: 4 + 4 bytes per shard element."""
    report = bf16(zero=1, offload_optimizer="cpu", grad_accum_steps=3)
    shard = report.ranks[0]["sharding"]["shard_numel"]
    transfers = report.ranks[0]["transfers"]
    steps = TINY["steps"]
    assert transfers["to_host_bytes"] == steps * shard * 4
    assert transfers["to_device_bytes"] == steps * shard * 4
    assert transfers["nvme_read_bytes"] == transfers["nvme_write_bytes"] == 0


def test_zero3_parameter_offload_fetches_my_shard_for_every_gather():
    """offload_param cpu: the parameter shard lives on the host; each gather of a unit
    brings my shard of it to the GPU (bf16) before the all-gather, in forward and in
    backward, and the step's new parameters stay on the host (no copy up)."""
    report = bf16(zero=3, offload_optimizer="cpu", offload_param="cpu")
    for rank in report.ranks:
        assert rank["memory"]["params"] == 0
        assert rank["memory_host"]["params"] == rank["sharding"]["shard_numel"] * 2
        # With dp = 2 an all-gather sends exactly my shard: every byte of my shard the
        # all-gathers sent first came up over PCIe, and nothing else did.
        assert rank["transfers"]["to_device_bytes"] == rank["comm"]["by_op"]["all_gather"]
        assert rank["transfers"]["copies"]["to_device"] > 0


def test_cpu_adam_replaces_the_gpu_optimizer_on_the_timeline():
    report = bf16(zero=2, offload_optimizer="cpu")
    kinds = {e.kind for e in report.timelines[0]}
    assert "host_optimizer" in kinds and "optimizer" not in kinds
    shard = report.ranks[0]["sharding"]["shard_numel"]
    host_s = report.ranks[0]["time"]["host_compute_s"]
    expected = TINY["steps"] * ADAMW_FLOPS_PER_ELEMENT * shard / PROFILE.host_flops
    assert host_s == pytest.approx(expected, rel=1e-12)
    assert report.ranks[0]["flops"]["optimizer"] == 0
    assert report.ranks[0]["flops"]["host_optimizer"] == pytest.approx(
        TINY["steps"] * ADAMW_FLOPS_PER_ELEMENT * shard, rel=1e-12)


def test_nvme_holds_the_optimizer_state_and_swaps_it_through_the_host():
    report = bf16(zero=3, offload_optimizer="nvme")
    rank = report.ranks[0]
    on_gpu = bf16(zero=3).ranks[0]
    assert rank["memory_nvme"]["optimizer"] == on_gpu["memory"]["optimizer"]
    shard_state = on_gpu["memory"]["optimizer"]
    # each step reads the master, m and v of every shard and writes them back
    assert rank["transfers"]["nvme_read_bytes"] == TINY["steps"] * shard_state
    assert rank["transfers"]["nvme_write_bytes"] == TINY["steps"] * shard_state


@pytest.mark.parametrize("settings, match", [
    (dict(zero=2, offload_param="cpu"), "--offload-param cpu needs --zero 3"),
    (dict(zero=0, offload_optimizer="cpu"), "--offload-optimizer cpu needs --zero 1, 2 or 3"),
    (dict(zero=1, offload_optimizer="nvme"), "--offload-optimizer nvme needs --zero 3"),
])
def test_mixes_deepspeed_does_not_run_are_refused_with_the_reason(settings, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**{**TINY, "dp": 2, **settings})


def test_an_unknown_offload_device_is_a_config_error():
    with pytest.raises(ConfigError, match="--offload-optimizer: must be one of none, cpu, nvme"):
        TrainConfig(offload_optimizer="gpu")
