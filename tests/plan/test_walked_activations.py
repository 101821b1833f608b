"""The walk of a pipeline rank's compute order (plan/walked_activations.py): what it
holds when, and that walking 2p micro-batches finds the peak of any longer step; and
the zero-bubble schedules' activation peak, which the walk takes from what a split
backward's I keeps for its W (plan/split_backward.py), against the bytes the emulator's
ledger measured on every pipeline rank (the other emulator-backed checks of the walk
are in test_experts.py and test_estimate.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.plan import memory, presets
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import from_train_config
from minipar.plan.walked_activations import (
    compute_orders,
    peak_of,
    walked_messages,
    walked_micro_batches,
    walked_peak,
)
from minipar.train import TrainConfig, train


def test_a_later_chunks_working_set_can_set_the_peak():
    """Interleaved, m = p = 2: every forward first, then the backwards of chunk 1 (the
    head's) and of chunk 0. Chunk 0 recomputes a larger segment than chunk 1 saves: its
    backward, after chunk 1's micro-batches are freed, is the peak, not the head's."""
    order = compute_orders("interleaved", 2, 2, 2)[1]
    assert order == (("F", 0), ("F", 0), ("F", 1), ("F", 1),
                     ("B", 1), ("B", 1), ("B", 0), ("B", 0))
    held, working = (10, 3), (40, 1)
    assert peak_of(order, held, working) == 2 * 10 + 40
    assert peak_of(order, (10, 3), (0, 1)) == 2 * 10 + 2 * 3 + 1  # the head's, then


def test_a_split_backward_holds_its_micro_batch_until_w():
    order = [("F", 0), ("I", 0), ("F", 0), ("W", 0), ("I", 0), ("W", 0)]
    assert peak_of(order, (5,), (2,)) == 2 * 5


def test_between_i_and_w_a_micro_batch_holds_what_its_i_kept():
    """F adds held (10); I adds its working set on top (4), then leaves kept (3) in
    place of held; W frees kept. Here the second I runs before the first W."""
    order = [("F", 0), ("I", 0), ("F", 0), ("I", 0), ("W", 0), ("W", 0)]
    assert peak_of(order, (10,), (0,), kept=(3,), input_working=(4,)) == 3 + 10 + 4
    assert peak_of(order, (10,), (0,), kept=(3,), input_working=(0,)) == 3 + 10
    # a W that keeps more than the forward saved (sequence parallelism's all-gathered
    # output gradients): the second micro-batch's I is the peak
    assert peak_of(order, (10,), (0,), kept=(12,), input_working=(2,)) == 12 + 10 + 2


def walked_schedules():
    """(schedule, chunks) of every walked rank: several chunks, or a split backward."""
    for name, spec in SCHEDULES.items():
        fewest, most = spec.virtual_stages
        for v in range(fewest, (most or 3) + 1):
            if v > 1 or spec.split_backward:
                yield name, v


@pytest.mark.parametrize("name, v", list(walked_schedules()))
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_two_p_micro_batches_find_the_peak_of_any_step(name, v, p):
    spec = SCHEDULES[name]
    step = p if spec.micro_batches_multiple_of_pp else 1
    fewest = -(-spec.min_micro_batches(p) // step) * step
    rng = random.Random(p * 10 + v)
    for m in range(fewest, 6 * p + 1, step):
        assert walked_micro_batches(name, p, m) == min(m, max(2 * p, fewest))
        for _ in range(3):
            held = [rng.randint(1, 100) for _ in range(v)]
            working = [rng.randint(0, 150) for _ in range(v)]
            kept = [rng.randint(0, 150) for _ in range(v)]
            input_working = [rng.randint(0, 150) for _ in range(v)]
            for rank, order in enumerate(compute_orders(name, p, m, v)):
                assert walked_peak(name, p, m, rank, held, working) == peak_of(
                    order, held, working), (m, rank)
                assert walked_peak(name, p, m, rank, held, working, kept,
                                   input_working) == peak_of(
                    order, held, working, kept, input_working), (m, rank)


# ------------------------------------------------------------------ against the emulator
TOY = dict(seq_len=8, n_head=2, d_model=16, vocab_size=32, data="synthetic", steps=1,
           micro_batch_size=2, precision="fp64")
FULL = dict(recompute_granularity="full")
BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
UNIFORM_2 = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=2)
SELECTIVE = dict(recompute_granularity="selective")


def planned_and_measured(settings: dict):
    """(the planner's stage, the ledger's memory of its rank at dp 0, tp 0) per pipeline
    rank of the TOY trained one step with `settings`."""
    config = TrainConfig(**{**TOY, **settings})
    report = train(config)
    shape = from_train_config(config, report.config["vocab_size"])
    est = estimate(shape, ParallelConfig.from_train_config(config),
                   ClusterSpec.from_device_profile(gpus_per_node=8), all_stages=True)
    for stage in est.stages:
        (measured,) = [r for r in report.ranks
                       if all(r["coords"].get(axis, 0) == (stage.rank if axis == "pp" else 0)
                              for axis in r["coords"])]
        yield stage, measured["memory"]


def zb(schedule: str, pp: int, n_layer: int, m: int, **flags) -> dict:
    return dict(schedule=schedule, virtual_stages=2 if schedule == "zb-v" else 1, pp=pp,
                n_layer=n_layer, grad_accum_steps=m, **flags)


ZERO_BUBBLE = [
    # every recomputation, several pp sizes and micro-batch counts
    ("zb-h1 pp2 m4", zb("zb-h1", 2, 4, 4)),
    ("zb-h1 pp3 m7 selective", zb("zb-h1", 3, 6, 7, **SELECTIVE)),
    ("zb-h1 pp2 m5 full", zb("zb-h1", 2, 4, 5, **FULL)),
    ("zb-h1 pp3 m9 block", zb("zb-h1", 3, 6, 9, **BLOCK)),
    ("zb-h2 pp2 m4", zb("zb-h2", 2, 4, 4)),
    ("zb-h2 pp3 m6 selective", zb("zb-h2", 3, 6, 6, **SELECTIVE)),
    ("zb-h2 pp2 m6 full", zb("zb-h2", 2, 4, 6, **FULL)),
    ("zb-h2 pp2 m4 block", zb("zb-h2", 2, 4, 4, **BLOCK)),
    ("zb-v pp2 m4", zb("zb-v", 2, 8, 4)),
    ("zb-v pp3 m6 selective", zb("zb-v", 3, 12, 6, **SELECTIVE)),
    ("zb-v pp2 m4 full", zb("zb-v", 2, 4, 4, **FULL)),
    ("zb-v pp3 m7 block", zb("zb-v", 3, 12, 7, **BLOCK)),
    ("zb-v pp2 m6 uniform 2", zb("zb-v", 2, 8, 6, **UNIFORM_2)),
    # the shapes the walk's I replays op by op
    ("zb-h1 tp2", zb("zb-h1", 2, 4, 4, tp=2)),
    ("zb-h2 tp2 sp swiglu", zb("zb-h2", 2, 4, 5, tp=2, sequence_parallel=True,
                               mlp="swiglu")),
    ("zb-v tp2 sp bf16 selective", zb("zb-v", 2, 8, 6, tp=2, sequence_parallel=True,
                                      precision="bf16-mixed", **SELECTIVE)),
    ("zb-h1 gqa fp32 untied", zb("zb-h1", 2, 4, 4, n_kv_head=1, precision="fp32",
                                 tie_embeddings=False)),
    ("zb-h2 pp3 dropout swiglu", zb("zb-h2", 3, 6, 7, dropout=0.1, mlp="swiglu")),
    ("zb-v cp2 tp2 sp", zb("zb-v", 2, 8, 4, cp=2, tp=2, sequence_parallel=True)),
    ("zb-h1 moe", zb("zb-h1", 2, 4, 4, moe_num_experts=4, moe_top_k=2, micro_batch_size=1)),
    ("zb-v moe ep2", zb("zb-v", 2, 8, 4, dp=2, ep=2, moe_num_experts=4, moe_top_k=2,
                        moe_capacity_factor=2.0)),
    ("zb-h2 moe tp2 sp ep4 block", zb("zb-h2", 2, 4, 5, dp=4, ep=4, tp=2,
                                      sequence_parallel=True, moe_num_experts=4,
                                      moe_top_k=2, **BLOCK)),
]


@pytest.mark.parametrize("settings", [s for _, s in ZERO_BUBBLE],
                         ids=[name for name, _ in ZERO_BUBBLE])
def test_zero_bubble_activations_are_the_emulators(settings):
    """Between a micro-batch's I and its W the rank holds what the I kept (linear
    layers' inputs and output gradients, norms' weight gradients; nothing of a
    checkpointed layer), not what the forward saved: with it the walked peak is the
    ledger's, on every pipeline rank."""
    for stage, measured in planned_and_measured(settings):
        assert stage.memory["activations"] == measured["activations"], stage.rank


@pytest.mark.parametrize("name, v", list(walked_schedules()))
def test_message_walk_by_default_recomputes_no_layer(name, v):
    """Without `checkpointed`, every chunk is layers that are not recomputed: a split
    backward's W forms their weight gradients (and re-gathers for them), its I none."""
    plain = ((False, False),) * v
    for rank in range(3):
        assert walked_messages(name, 3, 6, rank, v, None, 10, 25) == walked_messages(
            name, 3, 6, rank, v, plain, 10, 25)


def pipeline(schedule: str, pp: int, m: int, v: int = 1, **flags) -> dict:
    return dict(schedule=schedule, virtual_stages=v, pp=pp, n_layer=2 * pp * v,
                grad_accum_steps=m, **flags)


MESSAGES = [
    # interleaved: a rank's middle chunk both receives gradients and sends them back
    ("interleaved pp2 m2", pipeline("interleaved", 2, 2, 2)),
    ("interleaved pp2 m4 full", pipeline("interleaved", 2, 4, 2, **FULL)),
    ("interleaved pp3 m6 selective", pipeline("interleaved", 3, 6, 2, **SELECTIVE)),
    ("interleaved pp2 m4 cp2", pipeline("interleaved", 2, 4, 2, cp=2)),
    # a split backward: the input and its gradient go with the I's send, the output
    # gradient stays for the W, unless the chunk's last layer is checkpointed
    ("zb-h1 pp2 m2", pipeline("zb-h1", 2, 2)),
    ("zb-h1 pp3 m5 full", pipeline("zb-h1", 3, 5, **FULL)),
    ("zb-h1 pp3 m5 block", pipeline("zb-h1", 3, 5, **BLOCK)),
    ("zb-h2 pp3 m6 full bf16", pipeline("zb-h2", 3, 6, precision="bf16-mixed", **FULL)),
    ("zb-v pp2 m4", pipeline("zb-v", 2, 4, 2)),
    ("zb-v pp3 m6 full tp2", pipeline("zb-v", 3, 6, 2, tp=2, **FULL)),
    # DualPipe-V's V tip hands its micro-batch over in memory
    ("dualpipe-v pp2 m4", pipeline("dualpipe-v", 2, 4, 2)),
    ("dualpipe-v pp3 m6 selective", pipeline("dualpipe-v", 3, 6, 2, **SELECTIVE)),
    # one chunk, an unsplit backward: the closed form
    ("gpipe pp3 m7", pipeline("gpipe", 3, 7)),
    ("1f1b pp4 m9 full", pipeline("1f1b", 4, 9, **FULL)),
    # sequence parallelism re-gathers a layer's input where its weight gradients are
    # formed (a B; a W, or the I of a checkpointed layer), beside the messages then
    ("1f1b pp4 m5 tp2 sp", pipeline("1f1b", 4, 5, tp=2, sequence_parallel=True)),
    ("gpipe pp3 m4 tp2 sp selective", pipeline("gpipe", 3, 4, tp=2, sequence_parallel=True,
                                               **SELECTIVE)),
    ("interleaved pp2 m4 tp2 sp", pipeline("interleaved", 2, 4, 2, tp=2,
                                           sequence_parallel=True)),
    ("zb-h1 pp3 m4 tp2 sp", pipeline("zb-h1", 3, 4, tp=2, sequence_parallel=True)),
    ("zb-h1 pp3 m4 tp2 sp full", pipeline("zb-h1", 3, 4, tp=2, sequence_parallel=True,
                                          **FULL)),
    ("zb-h2 pp2 m4 tp2 sp block", pipeline("zb-h2", 2, 4, tp=2, sequence_parallel=True,
                                           **BLOCK)),
    ("zb-v pp3 m5 tp2 sp full bf16", pipeline("zb-v", 3, 5, 2, tp=2, sequence_parallel=True,
                                              precision="bf16-mixed", **FULL)),
    ("dualpipe-v pp2 m4 tp2 sp", pipeline("dualpipe-v", 2, 4, 2, tp=2,
                                          sequence_parallel=True)),
]


@pytest.mark.parametrize("settings", [s for _, s in MESSAGES],
                         ids=[name for name, _ in MESSAGES])
def test_pipeline_message_buffers_are_the_emulators(settings):
    """What a rank holds of the pipeline's messages (received inputs until their
    gradients are sent back, received output gradients until B or W, the input gradient
    being sent), and sequence parallelism's re-gathered input beside them, walked over
    its schedule: the ledger's "buffers" on every pipeline rank (one replica: nothing
    else is a buffer)."""
    for stage, measured in planned_and_measured(settings):
        assert stage.memory["buffers"] == measured["buffers"], stage.rank


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_one_stage_does_not_split_its_backward(schedule):
    """pp = 1 trains the model without a pipeline (train/build.py): a zero-bubble
    schedule's name changes nothing, so its activations are 1F1B's, the ledger's."""
    settings = dict(TOY, pp=1, n_layer=3, grad_accum_steps=4, tp=2, sequence_parallel=True,
                    recompute_granularity="selective", precision="bf16-mixed")
    config = TrainConfig(**settings, schedule=schedule)
    report = train(config)
    shape = from_train_config(config, report.config["vocab_size"])
    (stage,) = estimate(shape, ParallelConfig.from_train_config(config),
                        ClusterSpec.from_device_profile(gpus_per_node=8), all_stages=True).stages
    (measured,) = [r for r in report.ranks if all(v == 0 for v in r["coords"].values())]
    assert stage.memory["activations"] == measured["memory"]["activations"]


@pytest.mark.parametrize("schedule, v, pp", [("zb-v", 2, 96), ("zb-h1", 1, 132)])
def test_beyond_the_walk_a_split_backward_is_bounded_above(schedule, v, pp, monkeypatch):
    """A pipeline too long to walk (WALK_LIMIT) holds, under a split backward, at most
    the schedule's k micro-batches in flight each as the most any chunk holds before or
    after its I, plus the largest working set: above what the walk finds on every rank
    (under sequence parallelism an I keeps more than its forward saved, which a closed
    form of the forward's bytes would miss)."""
    shape = dataclasses.replace(presets.model("llama2-7b"), n_layer=v * pp)
    config = ParallelConfig(tp=8, pp=pp, sequence_parallel=True, schedule=schedule,
                            virtual_stages=v, grad_accum_steps=2 * pp + 4,
                            flash_attention=True)
    cluster = presets.cluster("h100-80gb")
    bounded = estimate(shape, config, cluster, all_stages=True).stages
    monkeypatch.setattr(memory, "walkable", lambda *_: True)
    walked = estimate(shape, config, cluster, all_stages=True).stages
    assert [s.memory["activations"] >= w.memory["activations"]
            for s, w in zip(bounded, walked, strict=True)] == [True] * pp
    assert bounded[-1].memory["activations"] <= 1.05 * walked[-1].memory["activations"]
