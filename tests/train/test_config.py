"""TrainConfig: the batch arithmetic and clear errors for bad settings."""

import pytest

from minipar.train.config import ConfigError, TrainConfig


def test_global_batch_is_micro_times_accumulation_times_dp():
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=3, dp=2)
    assert config.global_batch_size == 4 * 3 * 2


def test_grad_accum_is_derived_from_global_batch():
    config = TrainConfig(micro_batch_size=2, global_batch_size=12, dp=3)
    assert config.grad_accum_steps == 2


def test_default_is_one_micro_batch_per_step():
    config = TrainConfig(micro_batch_size=5)
    assert (config.grad_accum_steps, config.global_batch_size) == (1, 5)


def test_global_batch_that_does_not_split_names_the_flag_and_the_fix():
    with pytest.raises(ConfigError) as err:
        TrainConfig(micro_batch_size=4, global_batch_size=10)
    message = str(err.value)
    assert message.startswith("--global-batch-size")
    assert "multiple of" in message and "8" in message and "12" in message


def test_inconsistent_global_batch_and_accumulation_is_refused():
    with pytest.raises(ConfigError, match="give only one"):
        TrainConfig(micro_batch_size=4, grad_accum_steps=2, global_batch_size=16)


@pytest.mark.parametrize("changes, flag", [
    ({"n_head": 3}, "--n-head"),
    ({"steps": 0}, "--steps"),
    ({"precision": "fp16"}, "--precision"),
    ({"zero": 4}, "--zero"),
    ({"schedule": "zigzag"}, "--schedule"),
    ({"lr": -1.0}, "--lr"),
    ({"dropout": 1.0}, "--dropout"),
    ({"micro_batch_size": 0}, "--micro-batch-size"),
])
def test_bad_settings_name_their_flag(changes, flag):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**changes)
    assert str(err.value).startswith(flag)
    assert err.value.field == flag[2:].replace("-", "_")


def test_replace_rederives_the_global_batch():
    config = TrainConfig(micro_batch_size=2, grad_accum_steps=2)
    assert config.replace(dp=2).global_batch_size == 8
    assert config.replace(global_batch_size=6).grad_accum_steps == 3


def test_round_trip_through_dict():
    config = TrainConfig(dp=2, micro_batch_size=3, grad_accum_steps=2, precision="fp64")
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_unknown_setting_is_refused():
    with pytest.raises(ConfigError, match="unknown setting"):
        TrainConfig.from_dict({"n_layers": 3})
