"""The schedule registry: every schedule's declared facts (bubble, activations in flight,
settings rules, placement) agree with its own action lists; a schedule registered by one
call is accepted by the config, both CLIs, the planner, the validator, the report schema,
the explorer and the training loop; each settings rule speaks with one message, naming
the fix."""

from __future__ import annotations

import dataclasses
import json

import pytest

from minipar.errors import ConfigError, ScheduleError
from minipar.parallel.pipeline.actions import Schedule
from minipar.parallel.pipeline.schedules.one_f_one_b import flushing_bubble
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.schedules.registry import (
    SCHEDULES,
    ScheduleSpec,
    check_schedule_settings,
    make_schedule,
    register_schedule,
    schedule_names,
    uniform_bubble_fraction,
)
from minipar.parallel.pipeline.simulator import in_flight_peak, simulate_step
from minipar.parallel.pipeline.split_backward import BackwardWeight
from minipar.plan.layout import ParallelConfig
from minipar.train.config import TrainConfig
from minipar.train.schema import SCHEMA_PATH

SETTINGS = [(p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12, 16)
            for v in (1, 2, 3)]


def accepted(name, p, m, v) -> bool:
    try:
        check_schedule_settings(name, p, m, v)
    except ScheduleError:
        return False
    return True


def idle_share(run) -> float:
    """Idle / total rank-time over the step of a simulated run (the measured bubble)."""
    end = max(run.finish)
    return 1 - (sum(run.compute) + sum(run.comm)) / (end * len(run.finish))


# --------------------------------------------------------------------------- declared facts
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_s_facts_are_what_its_action_lists_do(name):
    """For every setting its rules accept: the generator makes a schedule the validator
    passes, with the declared chunks and placement; the declared uniform bubble is the
    simulated idle share (for any t_b / t_f); the declared activations in flight are the
    peaks of its action lists, per rank and on the head's chunk; it declares a split
    backward where its lists hold a W."""
    spec = SCHEDULES[name]
    tried = 0
    for p, m, v in SETTINGS:
        if not accepted(name, p, m, v):
            continue
        tried += 1
        schedule = make_schedule(name, p, m, v)
        assert (schedule.name, schedule.virtual_stages) == (name, v)
        assert spec.accepts_chunks(v) and schedule.placement == spec.placement
        stages = sorted(schedule.virtual_stage(r, c) for r in range(p) for c in range(v))
        assert stages == list(range(p * v))  # every virtual stage on exactly one rank
        split = any(isinstance(a, BackwardWeight) for rank in schedule for a in rank)
        assert spec.split_backward == split
        if not split:  # a share that does not depend on t_b / t_f
            for backward_time in (1.0, 2.0, 3.5):
                run = simulate_step(schedule, 1.0, backward_time)
                assert idle_share(run) == pytest.approx(
                    uniform_bubble_fraction(name, p, m, v), abs=1e-12)
        run = simulate_step(schedule, 1.0, 2.0, weight=1.0)  # T_F = T_B = T_W
        assert idle_share(run) == pytest.approx(uniform_bubble_fraction(name, p, m, v),
                                                abs=1e-12)
        if spec.bubble_time is not None:  # the papers' bubble column, in their regime:
            # W the shortest of the three (a Linear's dW GEMM costs its dX GEMM)
            for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.2, 0.7), (1.3, 1.0, 1.0),
                            (1.0, 1.5, 0.5), (1.5, 0.9, 0.6)):
                run = simulate_step(schedule, f, b + w, weight=w)
                work = m * v * (f + b + w)
                assert max(run.finish) - work == pytest.approx(
                    spec.bubble_time(p, m, v, f, b, w), abs=1e-9), (p, m, v, f, b, w)
        for rank in range(p):
            assert spec.in_flight(p, m, v, rank) == in_flight_peak(schedule, rank)
        last = schedule.rank_of(p * v - 1)
        head_chunk = next(c for c in range(v) if schedule.virtual_stage(last, c) == p * v - 1)
        assert spec.head_in_flight(p, m, v) == in_flight_peak(schedule, last, head_chunk)
    assert tried >= 10  # the rules leave something to check


def test_the_rules_say_what_the_generators_need():
    assert accepted("1f1b", 4, 3, 1) and not accepted("1f1b", 4, 8, 2)
    assert accepted("interleaved", 2, 4, 3)
    assert not accepted("interleaved", 4, 6, 2)  # m a multiple of p
    assert not accepted("interleaved", 1, 4, 2)  # at least two ranks
    assert not accepted("interleaved", 2, 4, 1)  # at least two chunks


def test_the_report_schema_file_lists_the_registered_schedules():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    assert schema["properties"]["config"]["properties"]["schedule"]["enum"] == list(
        schedule_names()) == ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v",
                              "dualpipe-v"]


def test_names_are_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_schedule(SCHEDULES["gpipe"])


# --------------------------------------------------------------------------- a new schedule
def gpipe_reversed(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe with the backwards last-in first-out (micro-batch m-1 first), as torchgpipe
    runs them: a toy schedule to show what registering one takes."""
    m = micro_batches
    order = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))]
    return from_compute_orders("gpipe-reversed", pp, m, 1, [order] * pp)


TOY = ScheduleSpec("gpipe-reversed", gpipe_reversed, "GPipe, backwards last-in first-out",
                   uniform_bubble=flushing_bubble, bubble_formula="(p-1)/(m+p-1)",
                   in_flight=lambda p, m, v, rank: m)


@pytest.fixture
def toy():
    """The toy schedule, registered for one test only."""
    register_schedule(TOY)
    try:
        yield TOY.name
    finally:
        del SCHEDULES[TOY.name]


def test_a_registered_schedule_is_made_and_validated(toy):
    schedule = make_schedule(toy, pp=2, micro_batches=3)
    assert schedule.compute_order(0) == "F0 F1 F2 B2 B1 B0"
    assert toy in schedule_names()
    assert uniform_bubble_fraction(toy, 4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ScheduleError, match=r"--virtual-stages: the gpipe-reversed schedule "
                                            r"runs one model chunk"):
        make_schedule(toy, 2, 4, 2)


def test_a_schedule_is_validated_once_per_generator_and_sizes(toy):
    """Every pipeline rank makes the same schedule: one validated copy serves them all
    (a Schedule is frozen), and a schedule registered again under a new generator, or one
    that fails validation, is never served from an earlier call."""
    first = make_schedule(toy, pp=2, micro_batches=3)
    assert make_schedule(toy, pp=2, micro_batches=3) is first
    assert make_schedule(toy, pp=2, micro_batches=4) is not first

    def broken(pp, micro_batches, virtual_stages=1):  # every rank waits for a receive
        order = [("B", i, 0) for i in range(micro_batches)]
        return from_compute_orders(toy, pp, micro_batches, 1, [order] * pp)

    SCHEDULES[toy] = dataclasses.replace(TOY, generate=broken)
    for _ in range(2):  # refused each time: a failed validation is not remembered
        with pytest.raises(ScheduleError):
            make_schedule(toy, pp=2, micro_batches=3)


def test_a_registered_schedule_is_a_choice_of_both_command_lines(toy):
    from minipar.cli import build_parser

    args = build_parser().parse_args(["train", "--schedule", toy, "--pp", "2"])
    assert args.schedule == toy
    plan = build_parser().parse_args(["plan", "--model", "gpt2", "--gpus", "2", "--pp", "2",
                                      "--schedule", toy])
    assert plan.schedule == toy


def test_a_registered_schedule_is_planned(toy):
    from minipar.plan import estimate, presets

    config = ParallelConfig(pp=4, schedule=toy, grad_accum_steps=8)
    shape, cluster = presets.model("gpt2"), presets.cluster("a100")
    exact = estimate(shape, config, cluster)  # simulates its action lists
    closed = estimate(shape, config, cluster, exact_pipeline=False)
    assert all(s.in_flight == 8 for s in exact.stages)
    assert exact.step_time == pytest.approx(closed.step_time, rel=0.05)
    assert exact.time["bubble_fraction"] > 0


def test_a_registered_schedule_trains_equal_to_one_device_and_reports(toy):
    from minipar.train import train, validate_report
    from minipar.train.mixes import check_layout

    config = TrainConfig(seq_len=8, n_layer=2, d_model=16, n_head=2, micro_batch_size=2,
                         grad_accum_steps=3, steps=1, vocab_size=52, precision="fp64",
                         pp=2, schedule=toy, data="synthetic", check=True)
    assert check_layout(config) == []
    report = train(config)
    assert report.equivalence["passed"]
    assert report.pipeline["schedule"] == toy
    assert report.pipeline["uniform_bubble_fraction"] == pytest.approx(1 / 4)
    validate_report(report.to_dict())


def test_a_registered_schedule_is_an_option_of_the_pipeline_explorer(toy):
    pytest.importorskip("ipywidgets")
    from minipar.viz.widgets import PipelineExplorer

    explorer = PipelineExplorer(schedule=toy, pp=2, micro_batches=2)
    assert toy in explorer.controls["schedule"].options
    assert explorer.error is None and "(p-1)/(m+p-1)" in explorer.status.value


# --------------------------------------------------------------------------- one message per rule
@pytest.mark.parametrize("name, p, m, v, match", [
    ("interleaved", 4, 6, 2, r"--grad-accum-steps.*multiple of 4.*4 or 8"),
    ("interleaved", 2, 1, 2, r"--grad-accum-steps.*multiple of 2"),
    ("interleaved", 4, 8, 1, r"--virtual-stages.*at least 2"),
    # the fix it suggests would be refused next: it says what else it needs
    ("interleaved", 4, 5, 1, r"--virtual-stages 2 with --grad-accum-steps a multiple of 4"),
    ("interleaved", 1, 4, 2, r"--pp.*at least 2 pipeline ranks"),
    ("1f1b", 4, 8, 2, r"--virtual-stages 2.*--schedule interleaved"),
    ("gpipe", 2, 4, 3, r"--virtual-stages 3"),
    ("zigzag", 2, 4, 1, r"--schedule: unknown.*gpipe, 1f1b, interleaved"),
    ("1f1b", 2, 0, 1, r"micro_batches.*positive integer"),
    ("gpipe", 0, 4, 1, r"pp must be a positive integer"),
])
def test_impossible_settings_are_clear_errors(name, p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        make_schedule(name, p, m, v)


@pytest.mark.parametrize("settings, field", [
    (dict(pp=4, schedule="interleaved", virtual_stages=2, grad_accum_steps=6),
     "grad_accum_steps"),
    (dict(pp=2, virtual_stages=2, grad_accum_steps=2), "virtual_stages"),
])
def test_schedule_rules_say_the_same_in_the_simulator_the_trainer_and_the_planner(settings,
                                                                                   field):
    from minipar.train.mixes import check_layout

    with pytest.raises(ScheduleError) as schedule_error:
        check_schedule_settings(settings.get("schedule", "1f1b"), settings["pp"],
                                settings["grad_accum_steps"], settings["virtual_stages"])
    with pytest.raises(ConfigError) as layout_error:
        check_layout(TrainConfig(n_layer=8, vocab_size=52, **settings))
    with pytest.raises(ConfigError) as plan_error:
        ParallelConfig(**settings)
    assert layout_error.value.field == plan_error.value.setting == field
    assert str(schedule_error.value) == str(layout_error.value) == str(plan_error.value)


@pytest.mark.parametrize("settings, field", [
    (dict(zero=4), "zero"),
    (dict(precision="fp16"), "precision"),
    (dict(schedule="zigzag"), "schedule"),
    (dict(dp=0), "dp"),
    (dict(bucket_size_mb=-1), "bucket_size_mb"),
    (dict(micro_batch_size=4, global_batch_size=10), "global_batch_size"),
    (dict(micro_batch_size=4, grad_accum_steps=2, global_batch_size=16), "global_batch_size"),
])
def test_the_planner_refuses_what_train_config_refuses_with_its_words(settings, field):
    with pytest.raises(ConfigError) as config_error:
        TrainConfig(**settings)
    with pytest.raises(ConfigError) as plan_error:
        ParallelConfig(**settings)
    assert config_error.value.field == plan_error.value.setting == field
    assert str(config_error.value) == str(plan_error.value)
