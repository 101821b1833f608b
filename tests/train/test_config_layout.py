"""One layout type: the trainer's TrainConfig and the planner's ParallelConfig are built on
the same Layout, each setting defined (and checked) once; TrainConfig is its four sections,
flat."""

import dataclasses

import pytest

from minipar.errors import ConfigError
from minipar.nn.gpt import GPTConfig
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import ModelShape, from_train_config
from minipar.train.config import (
    ModelSettings,
    OptimizerSettings,
    RunSettings,
    TrainConfig,
    gpt_config,
)
from minipar.train.layout import Layout

SECTIONS = (ModelSettings, Layout, OptimizerSettings, RunSettings)
# The planner's own settings beside the layout, and the defaults it sets to a real run's.
PLANNER_ONLY = {"flash_attention", "layer_split", "lr", "memory_accounting", "tp_comm_overlap",
                "overlap_param_gather", "cross_entropy_loss_fusion", "fp8_format",
                "fp8_param_gather", "rank_order", "reductions_in_flight"}
PLANNER_DEFAULTS = {"micro_batch_size": 1, "precision": "bf16-mixed", "bucket_size_mb": 0.0}

# A TrainConfig whose every layout setting differs from its default (built, not run:
# check_layout would refuse ZeRO-3 with a pipeline).
EVERY_LAYOUT_SETTING = dict(
    dp=4, tp=2, pp=2, cp=2, cp_load_balance=False, ep=2, zero=3, offload_optimizer="cpu",
    offload_param="cpu", schedule="interleaved", virtual_stages=2, sequence_parallel=True,
    bucket_size_mb=1.0, overlap_grad_reduce=False, zero3_prefetch=False, micro_batch_size=2,
    grad_accum_steps=2, global_batch_size=16, precision="bf16-mixed", grad_accum_dtype="fp32",
    recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
    hsdp_shard_size=4, zero_hpz_partition_size=2, zero_quantized_weights=True,
    reshard_after_forward=2, n_layer=4, moe_num_experts=4)
# ZeRO++'s qgZ is refused with TP (its blocks would let the TP replicas drift): its own
# layout, the rest as above
WITH_QGZ = dict(EVERY_LAYOUT_SETTING, tp=1, zero_quantized_gradients=True)


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_a_train_config_is_its_four_sections_each_field_in_exactly_one():
    assert issubclass(TrainConfig, SECTIONS)
    assert names(TrainConfig) == [n for section in SECTIONS for n in names(section)]
    assert len(set(names(TrainConfig))) == len(names(TrainConfig))


def test_the_trainer_and_the_planner_share_the_layouts_field_definitions():
    """Each layout field is Layout's own Field object in both configs (not a copy): a
    field added to Layout is a TrainConfig setting, a CLI flag and a ParallelConfig
    setting at once."""
    for field in dataclasses.fields(Layout):
        assert TrainConfig.__dataclass_fields__[field.name] is field
        if field.name not in PLANNER_DEFAULTS:
            assert ParallelConfig.__dataclass_fields__[field.name] is field
    assert set(names(ParallelConfig)) == set(names(Layout)) | PLANNER_ONLY
    defaults = {name: ParallelConfig.__dataclass_fields__[name].default
                for name in PLANNER_DEFAULTS}
    assert defaults == PLANNER_DEFAULTS


def test_every_layout_field_is_a_flag_of_minipar_train_and_of_minipar_plan():
    from minipar.cli import build_parser, config_from_args

    for settings in (EVERY_LAYOUT_SETTING, WITH_QGZ):
        argv = []
        for name, value in settings.items():
            flag = "--" + name.replace("_", "-")
            argv += ([flag] if value is True else [f"--no-{flag[2:]}"] if value is False
                     else [flag, str(value)])
        assert config_from_args(build_parser().parse_args(["train", *argv])) == TrainConfig(
            **settings)
        planned = build_parser().parse_args(["plan", "--model", "gpt2", *argv])
        for name, value in settings.items():
            assert getattr(planned, name) == value
    # and each field carries the one help line both flags show
    for section in SECTIONS:
        assert all(f.metadata.get("help") for f in dataclasses.fields(section))


def test_from_train_config_carries_every_layout_setting():
    configs = [TrainConfig(**EVERY_LAYOUT_SETTING), TrainConfig(**WITH_QGZ)]
    for field in dataclasses.fields(Layout):  # a real check: each set in one of them
        assert any(getattr(c, field.name) != field.default for c in configs), field.name
    for config in configs:
        planned = ParallelConfig.from_train_config(config)
        for field in dataclasses.fields(Layout):
            assert getattr(planned, field.name) == getattr(config, field.name), field.name
        assert planned.lr == config.lr


def test_the_model_section_is_the_models_config_and_shape():
    config = TrainConfig(vocab_size=60, seq_len=16, n_layer=3, n_head=2, d_model=8,
                         tie_embeddings=False, moe_num_experts=4, moe_top_k=1,
                         moe_capacity_factor=2.0, moe_aux_loss_coeff=0.1, moe_layer_freq=2)
    model = gpt_config(config)
    assert names(GPTConfig) == names(ModelSettings)
    assert all(getattr(model, n) == getattr(config, n) for n in names(ModelSettings))
    shape = from_train_config(config)
    shared = set(names(ModelSettings)) & set(names(ModelShape))
    assert shared == set(names(ModelSettings)) - {"moe_aux_loss_coeff"}  # changes no count
    assert all(getattr(shape, n) == getattr(config, n) for n in shared)


def test_the_flat_api_is_the_dataclasses():
    config = TrainConfig(dp=2, zero=1, micro_batch_size=2, grad_accum_steps=3)
    assert (config.dp, config.zero, config.global_batch_size) == (2, 1, 12)
    assert list(config.to_dict()) == names(TrainConfig)  # the report's config, flat
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.replace(dp=4).global_batch_size == 24
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dp = 4  # a config is a value: replace() makes another
    assert len({config, TrainConfig.from_dict(config.to_dict())}) == 1


def test_a_layout_rule_says_the_same_in_the_trainer_and_the_planner():
    for settings in (dict(dp=2, ep=4), dict(zero=5), dict(offload_param="cpu", zero=2),
                     dict(micro_batch_size=4, global_batch_size=6), dict(bucket_size_mb=-1)):
        with pytest.raises(ConfigError) as trainer:
            TrainConfig(**settings)
        with pytest.raises(ConfigError) as planner:
            ParallelConfig(**settings)
        assert str(trainer.value) == str(planner.value)


def test_the_activation_checkpointing_alias_is_gone():
    """--recompute-granularity full (without a method: every layer) is the one spelling."""
    assert "activation_checkpointing" not in names(TrainConfig)
    assert "activation_checkpointing" not in names(ParallelConfig)
    with pytest.raises(ConfigError, match="unknown setting"):
        TrainConfig.from_dict({"activation_checkpointing": True})
    full = TrainConfig(recompute_granularity="full").recompute
    assert (full.granularity, full.method, full.num_layers) == ("full", "uniform", 1)
