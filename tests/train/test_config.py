"""TrainConfig: the batch arithmetic and clear errors for bad settings."""

import dataclasses
import json

import numpy as np
import pytest

from minipar.errors import ConfigError
from minipar.train.config import TrainConfig


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


# ------------------------------------------------------------------ absurd numbers
NON_FINITE = [
    ("lr", float("inf")), ("lr", float("nan")), ("lr", 1e308), ("lr", 2.0),
    ("min_lr", float("nan")),
    ("weight_decay", float("nan")), ("weight_decay", float("inf")), ("weight_decay", 1e4),
    ("grad_clip", float("nan")), ("grad_clip", float("inf")),
    ("bucket_size_mb", float("nan")), ("bucket_size_mb", float("inf")),
    ("beta1", float("nan")), ("dropout", float("nan")),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("warmup_steps", -1), ("lr", "0.1"),
]


@pytest.mark.parametrize("field, value", NON_FINITE)
def test_non_finite_or_absurd_hyperparameters_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"^--{field.replace('_', '-')}: ") as info:
        TrainConfig(**{field: value})
    assert info.value.setting == field


@pytest.mark.parametrize("flag, value", [
    ("--lr", "inf"), ("--lr", "nan"), ("--lr", "1e308"), ("--weight-decay", "nan"),
    ("--weight-decay", "inf"), ("--grad-clip", "nan"), ("--grad-clip", "inf"),
    ("--bucket-size-mb", "nan"), ("--bucket-size-mb", "inf"), ("--seed", "-1"),
])
def test_the_cli_refuses_them_in_one_line(capsys, flag, value):
    from minipar import cli

    assert cli.main(["train", "--quiet", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"minipar train: error: {flag}: ")


def test_the_limits_let_real_settings_through():
    TrainConfig(lr=1.0, weight_decay=0.5, grad_clip=0.0, bucket_size_mb=25.0, seed=2**63 - 1)


@pytest.mark.parametrize("setting, value", [("moe_top_k", 1), ("moe_capacity_factor", 2.0),
                                            ("moe_aux_loss_coeff", 0.0),
                                            ("moe_layer_freq", 2)])
def test_an_moe_setting_on_a_dense_model_is_refused_not_ignored(setting, value):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{setting: value})
    assert err.value.setting == setting and "without --moe-num-experts" in str(err.value)
    TrainConfig(moe_num_experts=4, **{setting: value})  # with experts it means something


@pytest.mark.parametrize("settings, flag", [
    (dict(grad_accum_steps=10**12), "grad_accum_steps"),  # asked for 29 TiB of token ids
    (dict(global_batch_size=4 * 10**12), "global_batch_size"),
    (dict(cp=10**12), "cp"),  # blamed --dp, with cp left out of the product
])
def test_sizes_no_run_could_finish_are_refused_naming_the_flag(settings, flag):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**settings)
    assert info.value.setting == flag


def test_a_flag_is_taken_only_when_spelled_out():
    """With argparse's abbreviations `--zero3` was `--zero3-prefetch`, and ran ZeRO-0."""
    from minipar.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["train", "--zero3"])
    assert info.value.code == 2


# ------------------------------------------------------------------ switches
BOOLEANS = ["tie_embeddings", "cp_load_balance", "sequence_parallel", "overlap_grad_reduce",
            "zero3_prefetch", "zero_quantized_weights", "zero_quantized_gradients", "check"]


def test_every_switch_a_config_declares_is_checked():
    """Every `bool` setting of the trainer's sections is in BOOLEANS above, so each is
    refused when given anything but True or False (a switch added later included)."""
    import dataclasses
    declared = {f.name for f in dataclasses.fields(TrainConfig) if f.type in ("bool", bool)}
    assert declared == set(BOOLEANS)


@pytest.mark.parametrize("name", BOOLEANS)
@pytest.mark.parametrize("value", ["False", "false", "", 0, 1, None, 1.0])
def test_a_switch_is_true_or_false_not_truthy(name, value):
    # TrainConfig(sequence_parallel='False') ran sequence parallelism: the string is true
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{name: value})
    assert str(err.value) == (f"--{name.replace('_', '-')}: must be True or False, got "
                              f"{value!r}")


def test_every_switch_of_the_config_is_checked():
    # a bool field added later is refused too, or this test names it
    switches = {f.name for f in dataclasses.fields(TrainConfig) if f.type in (bool, "bool")}
    assert switches == set(BOOLEANS)


def test_numpy_values_are_taken_as_the_python_values_they_hold():
    config = TrainConfig(sequence_parallel=np.True_, tp=np.int64(2), n_head=np.int32(4),
                         tie_embeddings=np.bool_(False), lr=np.float32(0.5))
    assert config.sequence_parallel is True and config.tie_embeddings is False
    assert type(config.tp) is int and config.tp == 2
    assert config == TrainConfig(sequence_parallel=True, tp=2, tie_embeddings=False,
                                 lr=float(np.float32(0.5)))
    json.dumps(config.to_dict())  # plain values: the report's config is JSON


@pytest.mark.parametrize("name", ["n_layer", "seed", "lr", "dp", "steps", "grad_accum_steps"])
@pytest.mark.parametrize("value", [10**5000, -(10**5000), 2**63],
                         ids=["5001-digits", "minus-5001-digits", "2**63"])
def test_an_integer_too_large_to_print_is_refused_in_one_line(name, value):
    # Python will not write an int of more than 4,300 digits (nor make it a float): the
    # refusal used to be that ValueError's traceback, or an OverflowError
    with pytest.raises(ConfigError) as refused:
        TrainConfig(**{name: value})
    message = str(refused.value)
    assert message.startswith(f"--{name.replace('_', '-')}: is an integer of ")
    assert "digits, beyond any setting" in message and len(message) < 200


def test_an_integer_too_large_to_print_is_refused_by_the_planner_too():
    from minipar.plan.layout import ParallelConfig
    from minipar.plan.shapes import ModelShape
    with pytest.raises(ValueError, match=r"ModelShape.d_model is an integer of 5,001 digits"):
        ModelShape(d_model=10**5000)
    with pytest.raises(ConfigError, match=r"--dp: is an integer of 5,001 digits"):
        ParallelConfig(dp=10**5000)
