"""The planner's pipeline step: a long schedule extrapolated from its steady state equals
the schedule walked whole, and the shortcuts of a deep model's costs are exact."""

from __future__ import annotations

import dataclasses

import pytest

from minipar.nn.recompute import Recompute
from minipar.plan import pipeline_extrapolation, pipeline_step, presets
from minipar.plan.buckets import Module, gradient_buckets
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.placement import replica_hops_crossing

UNIFORM = presets.cluster("a100").uniform()
SHAPE = presets.model("gpt2")


@pytest.fixture
def small_budget(monkeypatch):
    """Budgets at which a 4-stage pipeline of 64 micro-batches is extrapolated."""
    monkeypatch.setattr(pipeline_extrapolation, "SIMULATED_ACTIONS", 200)
    monkeypatch.setattr(pipeline_extrapolation, "EXTRAPOLATED_ACTIONS", 4_000)
    pipeline_extrapolation._simulated.cache_clear()
    yield
    pipeline_extrapolation._simulated.cache_clear()


@pytest.mark.parametrize("schedule, v, m", [
    ("gpipe", 1, 64), ("1f1b", 1, 63), ("interleaved", 2, 64), ("zb-h1", 1, 64),
    ("zb-h2", 1, 61), ("zb-v", 2, 64), ("dualpipe-v", 2, 64)])
def test_extrapolated_step_equals_the_whole_walk(small_budget, schedule, v, m):
    config = ParallelConfig(pp=4, dp=2, grad_accum_steps=m, schedule=schedule,
                            virtual_stages=v)
    whole = pipeline_step.walked_step_time(SHAPE, config, UNIFORM)
    fast = pipeline_extrapolation.simulated_step_time(SHAPE, config, UNIFORM)
    assert fast is not None and fast["simulated_micro_batches"] != [m]  # extrapolated
    assert max(fast["simulated_micro_batches"]) < m
    for key in ("step_s", "pipeline_s", "bubble_fraction", "mfu", "tokens_per_s"):
        assert fast[key] == pytest.approx(whole[key], rel=1e-9), key
    assert fast["rank_end_s"] == pytest.approx(whole["rank_end_s"], rel=1e-9)
    # a rank's exposed communication wobbles by a message per micro-batch: extrapolated
    # from the walks' span, within 0.5% of the step
    for ours, walked in zip(fast["rank_exposed_comm_s"], whole["rank_exposed_comm_s"],
                            strict=True):
        assert abs(ours - walked) <= 0.005 * whole["step_s"]


def test_a_short_schedule_is_walked_whole():
    config = ParallelConfig(pp=4, grad_accum_steps=8)
    walked = pipeline_step.walked_step_time(SHAPE, config, UNIFORM)
    found = pipeline_extrapolation.simulated_step_time(SHAPE, config, UNIFORM)
    assert found["simulated_micro_batches"] == [8]
    assert {k: v for k, v in found.items() if k != "simulated_micro_batches"} == walked


def test_the_issue_s_long_pipeline_is_walked_within_the_budget(monkeypatch):
    """pp 64 x 65,536 micro-batches: 8 million computations, walked as three short
    schedules."""
    walked = []
    real = pipeline_step.walked_step_time

    def counting(shape, config, cluster, scatter_gather=False):
        walked.append(pipeline_extrapolation.compute_actions(config))
        return real(shape, config, cluster, scatter_gather)

    monkeypatch.setattr(pipeline_step, "walked_step_time", counting)
    pipeline_extrapolation._simulated.cache_clear()
    config = ParallelConfig(pp=64, grad_accum_steps=65_536)
    found = pipeline_extrapolation.simulated_step_time(SHAPE, config, UNIFORM)
    assert found is not None and len(found["simulated_micro_batches"]) == 3
    assert 0 < sum(walked) <= pipeline_extrapolation.EXTRAPOLATED_ACTIONS
    pipeline_extrapolation._simulated.cache_clear()


def test_beyond_the_budget_the_closed_form_is_used(small_budget, monkeypatch):
    """When even the short walks cost too much, the estimate is timing.step_time's."""
    monkeypatch.setattr(pipeline_extrapolation, "EXTRAPOLATED_ACTIONS", 100)
    config = ParallelConfig(pp=4, grad_accum_steps=64)
    assert pipeline_extrapolation.simulated_step_time(SHAPE, config, UNIFORM) is None
    exact = estimate(SHAPE, config, UNIFORM)
    closed = estimate(SHAPE, config, UNIFORM, exact_pipeline=False)
    assert exact.step_time == closed.step_time


@pytest.mark.parametrize("recompute, n", [
    (Recompute("full", "uniform", 1), 7), (Recompute("full", "uniform", 3), 7),
    (Recompute("full", "block", 2), 7), (Recompute("full", "block", 9), 4),
    (Recompute("selective"), 5), (Recompute(), 5)])
def test_recomputed_layers_count_the_checkpointed_segments(recompute, n):
    assert recompute.recomputed_layers(n) == sum(
        end - start for start, end, ck in recompute.segments(n) if ck)


def test_one_bucket_is_the_general_loop_with_no_cap():
    """bucket_size_mb 0 takes a module at a time; the same bucket as tensor by tensor."""
    layer = Module("layer", 1.0, 2.0, (10, 20, 30), (False,) * 3, (0.25, 0.5, 0.75))
    modules = [Module("embedding", 0.5, 0.7, (50,), (True,)), *[layer] * 5,
               Module("empty", 0.1, 0.3, (), ()), Module("head", 0.3, 0.9, (40, 5),
                                                           (False, False))]
    config = ParallelConfig(dp=4, zero=1, bucket_size_mb=0)
    ones = gradient_buckets(modules, config)
    # the general loop, with a cap no bucket reaches
    general = gradient_buckets(modules, config.replace(bucket_size_mb=10**6))
    assert ones == general and len(ones) == 1


@pytest.mark.parametrize("config", [
    ParallelConfig(grad_accum_steps=2),
    ParallelConfig(pp=2, grad_accum_steps=8),
    ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2, grad_accum_steps=8),
    ParallelConfig(dp=4, zero=3, tp=2, sequence_parallel=True, grad_accum_steps=2),
    ParallelConfig(pp=4, schedule="zb-v", virtual_stages=2, grad_accum_steps=8),
])
def test_a_rank_s_peak_falls_as_block_recomputation_covers_more_layers(config):
    """lint's bisection for the fewest recomputed layers that fit assumes it."""
    shape = dataclasses.replace(presets.model("gpt2"), n_layer=48)
    chunk = 48 // (config.pp * config.virtual_stages)
    peaks = [estimate(shape, config.with_recompute(Recompute("full", "block", k)),
                      UNIFORM).memory["peak_total"] for k in range(1, chunk + 1)]
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:], strict=False))
    assert peaks[-1] < peaks[0]


def test_a_progress_line_is_printed_past_the_delay_only(capsys):
    import time

    from minipar.plan.cli import said_after

    with said_after(0.05, "working ..."):
        time.sleep(0.3)
    with said_after(5.0, "never said"):
        pass
    assert capsys.readouterr().err == "working ...\n"


def test_the_plan_says_when_its_pipeline_was_extrapolated(capsys):
    from minipar.cli import main

    assert main(["plan", "--model", "gpt2", "--pp", "4", "--grad-accum-steps", "65536"]) == 0
    out = capsys.readouterr().out
    assert "were walked at m = " in out and "extrapolated to m = 65,536" in out
    assert main(["plan", "--model", "gpt2", "--pp", "4", "--grad-accum-steps", "8"]) == 0
    assert "walked at" not in capsys.readouterr().out


def test_many_replica_placements_are_walked_as_one_crossing_wherever_any_does(monkeypatch):
    """Of 8 replicas of 7 ranks on 8-GPU nodes two stay inside a node and six cross, each
    on its own hop: 7 placements, more than MAX_REPLICA_WALKS whole simulations, so they
    are walked as one that crosses on all of those hops, an upper bound of walking
    each."""
    shape = dataclasses.replace(SHAPE, n_layer=14)
    config = ParallelConfig(pp=7, dp=8, grad_accum_steps=14)
    cluster = presets.cluster("a100")
    assert len(replica_hops_crossing(config, cluster.gpus_per_node)) == 7
    bound = pipeline_step.walked_step_time(shape, config, cluster)["step_s"]
    monkeypatch.setattr(pipeline_step, "MAX_REPLICA_WALKS", 8)
    each = pipeline_step.walked_step_time(shape, config, cluster)["step_s"]
    assert each < bound


def test_only_a_limit_of_reductions_in_flight_holds_the_schedule():
    """ZeRO-1 across nodes (GPT-2, dp 2 x pp 2 on 2-GPU nodes, 1 MiB buckets): DeepSpeed's
    two reductions in flight (the default, as minipar's emulator) stall backwards, and
    the stalls are held in the schedule's simulation, so the pipeline takes longer than
    the schedule alone; Megatron-LM's distributed optimizer (reductions_in_flight=None,
    param_and_grad_buffer.py) stalls nothing: its pipeline is the schedule as is."""
    cluster = dataclasses.replace(UNIFORM, gpus_per_node=2)
    deepspeeds = ParallelConfig(dp=2, pp=2, zero=1, grad_accum_steps=4, bucket_size_mb=1)
    megatrons = deepspeeds.replace(reductions_in_flight=None)
    forward, backward, weight = pipeline_step.chunk_costs(SHAPE, deepspeeds, cluster)
    (hops,) = replica_hops_crossing(deepspeeds, cluster.gpus_per_node)
    schedule = pipeline_step.simulate_step(
        pipeline_step.make_schedule("1f1b", 2, 4, 1), forward, backward,
        pipeline_step.p2p_message_seconds(SHAPE, deepspeeds, cluster, False, hops), weight)
    held = pipeline_step.walked_step_time(SHAPE, deepspeeds, cluster)
    free = pipeline_step.walked_step_time(SHAPE, megatrons, cluster)
    assert free["pipeline_s"] == max(schedule.finish)
    assert held["pipeline_s"] > 1.2 * max(schedule.finish)
    assert free["step_s"] < held["step_s"]
