"""ParallelConfig's batch arithmetic and validation, and what each pipeline rank holds,
checked against the schedules minipar's pipeline runs."""

from __future__ import annotations

import pytest

from minipar.errors import ConfigError
from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import in_flight_peak
from minipar.parallel.pipeline.stage import split_layers
from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.layout import (
    ParallelConfig,
    check_model_fits_layout,
    in_flight,
    layer_counts,
    representative_ranks,
    stage_plans,
)
from minipar.plan.shapes import ModelShape
from minipar.train import TrainConfig


def test_global_batch_is_micro_times_accumulation_times_dp():
    config = ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=64)
    assert config.grad_accum_steps == 8
    config = ParallelConfig(dp=4, micro_batch_size=2, grad_accum_steps=3)
    assert config.global_batch_size == 24
    assert config.replace(dp=8).global_batch_size == 48  # accumulation kept


@pytest.mark.parametrize("changes,setting", [
    (dict(dp=4, micro_batch_size=2, global_batch_size=60), "global_batch_size"),
    (dict(micro_batch_size=2, grad_accum_steps=3, global_batch_size=8), "global_batch_size"),
    (dict(zero=4), "zero"),
    (dict(precision="fp16"), "precision"),
    (dict(schedule="interleaved", pp=2, virtual_stages=1), "virtual_stages"),
    (dict(virtual_stages=2), "virtual_stages"),
    (dict(schedule="interleaved", pp=4, virtual_stages=2, grad_accum_steps=6),
     "grad_accum_steps"),
    (dict(tp=0), "tp"),
])
def test_bad_settings_name_the_flag(changes, setting):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**changes)
    assert info.value.setting == setting
    assert f"--{setting.replace('_', '-')}" in str(info.value)


def test_from_train_config_keeps_the_layout():
    train = TrainConfig(dp=2, tp=1, pp=1, zero=2, micro_batch_size=3, grad_accum_steps=5,
                        precision="bf16-mixed", recompute_granularity="full")
    config = ParallelConfig.from_train_config(train)
    assert (config.dp, config.zero, config.micro_batch_size, config.micro_batches,
            config.global_batch_size) == (2, 2, 3, 5, 30)
    assert config.recompute_granularity == "full" and config.precision == "bf16-mixed"


@pytest.mark.parametrize("layers,stages", [(4, 2), (7, 3), (12, 5), (70, 12), (3, 3)])
def test_layer_split_is_minipars(layers, stages):
    assert layer_counts(layers, stages) == [len(r) for r in split_layers(layers, stages)]


@pytest.mark.parametrize("schedule,p,m,v", [
    ("gpipe", 4, 6, 1), ("1f1b", 4, 2, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 5, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 4, 4, 3),
    ("interleaved", 3, 9, 2),
])
def test_micro_batches_in_flight_match_the_schedule(schedule, p, m, v):
    made = make_schedule(schedule, p, m, v)
    for rank in range(p):
        assert in_flight(schedule, p, rank, m, v) == in_flight_peak(made, rank)


def test_first_pipeline_rank_holds_the_embedding_and_the_last_the_head():
    shape = presets.model("gpt2")
    plans = stage_plans(shape, ParallelConfig(pp=4, grad_accum_steps=8), all_ranks=True)
    assert [p.first for p in plans] == [True, False, False, False]
    assert [p.last for p in plans] == [False, False, False, True]
    assert [p.tied_copy for p in plans] == [False, False, False, True]  # tied GPT-2 head
    assert sum(p.layers for p in plans) == shape.n_layer
    assert representative_ranks(4) == [0, 1, 3] and representative_ranks(1) == [0]


@pytest.mark.parametrize("model,tp,setting", [("llama2-70b", 16, "tp"), ("gpt2", 5, "tp")])
def test_model_must_split_over_the_layout(model, tp, setting):
    with pytest.raises(ConfigError) as info:
        check_model_fits_layout(presets.model(model), ParallelConfig(tp=tp))
    assert info.value.setting == setting


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="stages"):
        check_model_fits_layout(presets.model("gpt2"), ParallelConfig(pp=16,
                                                                       grad_accum_steps=16))
    with pytest.raises(ConfigError, match="layer-split"):
        check_model_fits_layout(presets.model("gpt2"),
                                ParallelConfig(pp=2, layer_split=(5, 6), grad_accum_steps=2))


def test_the_planners_switches_are_true_or_false():
    from minipar.plan.shapes import ModelShape

    with pytest.raises(ConfigError, match=r"^--flash-attention: must be True or False, "
                                          r"got 'no'$"):
        ParallelConfig(flash_attention="no")
    with pytest.raises(ConfigError, match=r"^--sequence-parallel: must be True or False"):
        ParallelConfig(tp=2, sequence_parallel="False")
    with pytest.raises(ValueError, match=r"^ModelShape.bias must be True or False, got 0$"):
        ModelShape(bias=0)


def test_a_layer_split_given_as_a_list_plans_as_the_tuple_does():
    # JSON and Python callers pass lists; the planner caches layouts by hash
    shape = ModelShape(name="x", n_layer=12, d_model=256, n_head=4, vocab_size=1000,
                       seq_len=128)
    listed = ParallelConfig(pp=2, layer_split=[7, 5], global_batch_size=8)
    tupled = ParallelConfig(pp=2, layer_split=(7, 5), global_batch_size=8)
    assert listed == tupled and hash(listed) == hash(tupled)
    cluster = presets.cluster("a100")
    assert estimate(shape, listed, cluster).time == \
        estimate(shape, tupled, cluster).time


# ------------------------------------------------------------------ the rank order
def test_minipars_rank_order_is_its_meshs():
    # the planner places ranks as the emulator does (one rule each side, held equal)
    from minipar.distributed.mesh import DeviceMesh

    config = ParallelConfig(dp=3, pp=2, cp=2, tp=2, grad_accum_steps=2)
    mesh = DeviceMesh(3, 2, 2, cp=2, world_size=24, gpus_per_node=8)
    assert [config.rank_at(**mesh.coords(r)) for r in range(24)] == list(range(24))


def test_megatrons_default_order_puts_the_pipeline_slowest():
    # megatron/core/parallel_state.py, generate_masked_orthogonal_rank_groups' docstring,
    # order tp-dp-pp with (tp, dp, pp) = (2, 3, 4): global_rank = tp_rank + dp_rank x
    # tp_size + pp_rank x tp_size x dp_size; dp_group[0] = [0, 2, 4], dp_group[7] =
    # [19, 21, 23]
    config = ParallelConfig(dp=3, pp=4, tp=2, grad_accum_steps=4,
                            rank_order="tp-cp-ep-dp-pp")
    assert [config.rank_at(d, 0, 0, 0) for d in range(3)] == [0, 2, 4]
    assert [config.rank_at(d, 3, 0, 1) for d in range(3)] == [19, 21, 23]
    assert config.strides == {"dp": 2, "pp": 6}
    # and its --use-tp-pp-dp-mapping order tp-pp-dp, (2, 2, 2): dp_group [[0, 4], [1, 5],
    # [2, 6], [3, 7]], which is minipar's mesh
    minipars = ParallelConfig(dp=2, pp=2, tp=2, grad_accum_steps=2)
    assert sorted([minipars.rank_at(d, p, 0, t) for d in range(2)]
                  for p in range(2) for t in range(2)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert minipars.strides == {"dp": 4, "pp": 2}


def test_an_unknown_rank_order_names_the_flag_and_the_orders():
    with pytest.raises(ConfigError) as info:
        ParallelConfig(rank_order="dp-pp-tp")
    assert info.value.setting == "rank_order"
    assert "tp-cp-ep-pp-dp" in str(info.value) and "tp-cp-ep-dp-pp" in str(info.value)
