"""Step time, bubble and MFU: the closed forms, and the exact simulation agreeing with
them when compute dominates."""

from __future__ import annotations

import pytest

from minipar.plan import presets
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig, stage_plan
from minipar.plan.shapes import ADAMW_FLOPS_PER_PARAMETER, ModelShape
from minipar.plan.timing import data_parallel_seconds, step_time

CLUSTER = presets.cluster("a100")
# The uniform model's identities (time = FLOPs / one rate, MFU = efficiency x model /
# executed FLOPs) hold on a cluster without a roofline; the a100 preset prices kernels by
# shape and bytes, so these tests switch its roofline off.
UNIFORM = CLUSTER.uniform()


def fake_stage(seconds):
    return {"micro_batch_s": seconds, "p2p_s": 0.0, "step_comm_s": 0.0, "optimizer_s": 0.0,
            "overlap_contention_s": 0.0}


@pytest.mark.parametrize("p,m", [(2, 4), (4, 16), (8, 8)])
def test_closed_form_bubble_for_uniform_stages(p, m):
    shape = presets.model("gpt2")
    config = ParallelConfig(pp=p, grad_accum_steps=m)
    ranks = sorted({0, 1, p - 1})
    time = step_time(config, [fake_stage(1.0)] * len(ranks), shape, CLUSTER, ranks)
    assert time["step_s"] == pytest.approx(m + p - 1)
    assert time["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))


def test_closed_form_interleaved_bubble_shrinks_by_v():
    p, m, v = 4, 8, 2
    config = ParallelConfig(pp=p, grad_accum_steps=m, schedule="interleaved",
                            virtual_stages=v)
    time = step_time(config, [fake_stage(1.0)] * 3, presets.model("gpt2"), CLUSTER, [0, 1, 3])
    assert time["step_s"] == pytest.approx(m + (p - 1) / v)


def test_single_gpu_step_is_flops_over_sustained_rate():
    shape = ModelShape(n_layer=4, d_model=256, n_head=4, vocab_size=1000, seq_len=128)
    config = ParallelConfig(micro_batch_size=2, grad_accum_steps=3, precision="fp32")
    est = estimate(shape, config, UNIFORM)
    layer_f, layer_b = shape.layer_flops(2)
    micro = (shape.n_layer * (layer_f + layer_b) + sum(shape.embedding_flops(2))
             + sum(shape.head_flops(2)))
    flops = 3 * micro + ADAMW_FLOPS_PER_PARAMETER * shape.n_params
    assert est.step_time == pytest.approx(flops / UNIFORM.sustained_flops, rel=1e-12)


def test_mfu_is_efficiency_times_model_over_executed_flops_on_one_gpu():
    shape = presets.model("gpt2-xl")
    config = ParallelConfig(micro_batch_size=4, grad_accum_steps=8)
    est = estimate(shape, config, UNIFORM)
    executed = est.step_time * UNIFORM.sustained_flops
    model = shape.model_flops_per_sequence() * config.global_batch_size
    assert est.mfu == pytest.approx(UNIFORM.efficiency * model / executed, rel=1e-12)
    assert 0.9 * UNIFORM.efficiency < est.mfu < UNIFORM.efficiency
    # full recomputation runs the forward twice: ~3/4 of the MFU (Korthikanti, section 5)
    recomputed = estimate(shape, config.replace(recompute_granularity="full"), UNIFORM)
    assert recomputed.mfu / est.mfu == pytest.approx(0.75, rel=0.02)


@pytest.mark.parametrize("name,config", [
    ("gpt3-175b", ParallelConfig(dp=8, tp=8, pp=8, zero=1, micro_batch_size=1,
                                 global_batch_size=1536, sequence_parallel=True,
                                 flash_attention=True)),
    ("llama2-70b", ParallelConfig(dp=8, tp=4, pp=2, zero=1, schedule="interleaved",
                                  virtual_stages=2, global_batch_size=1024,
                                  sequence_parallel=True, flash_attention=True)),
])
def test_closed_form_agrees_with_the_simulation_when_compute_dominates(name, config):
    shape = presets.model(name)
    exact = estimate(shape, config, CLUSTER)
    fast = estimate(shape, config, CLUSTER, exact_pipeline=False)
    assert fast.step_time == pytest.approx(exact.step_time, rel=0.01)


def test_emulated_cluster_prices_compute_at_the_profile_rate():
    spec = ClusterSpec.from_device_profile()
    shape = ModelShape(n_layer=1, d_model=32, n_head=4, vocab_size=32, seq_len=8)
    est = estimate(shape, ParallelConfig(precision="fp32"), spec)
    assert est.time["tokens_per_s"] == pytest.approx(8 / est.step_time)


def test_chunk_costs_follow_the_schedule_s_placement():
    """In a V rank 0 runs the first stage (embedding) and the last (head and loss): the
    planner prices rank 0's chunk 1 as the head's, not rank p-1's last chunk."""
    from minipar.plan.pipeline_step import chunk_costs

    shape = presets.model("gpt2")
    looped = ParallelConfig(pp=4, grad_accum_steps=8, schedule="interleaved",
                            virtual_stages=2)
    v_shape = ParallelConfig(pp=4, grad_accum_steps=8, schedule="zb-v", virtual_stages=2)
    forward_looped, _, _ = chunk_costs(shape, looped, UNIFORM)
    forward_v, _, _ = chunk_costs(shape, v_shape, UNIFORM)
    head_looped = forward_looped[3][1]  # stage 7 = 1 * 4 + 3
    head_v = forward_v[0][1]  # stage 7 = 2p - 1 - 0
    assert head_v == pytest.approx(head_looped, rel=1e-12)
    assert head_v > forward_v[3][1]  # rank 3's chunk 1 is stage 4: blocks only


@pytest.mark.parametrize("schedule, v", [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2),
                                         ("dualpipe-v", 2)])
def test_the_zero_bubble_schedules_are_planned_below_1f1b(schedule, v):
    """The planner simulates their action lists (I and W at half the backward each)."""
    shape = presets.model("gpt2")
    one_f_one_b = estimate(shape, ParallelConfig(pp=4, grad_accum_steps=8), UNIFORM)
    ours = estimate(shape, ParallelConfig(pp=4, grad_accum_steps=8, schedule=schedule,
                                          virtual_stages=v), UNIFORM)
    assert ours.time["bubble_fraction"] < one_f_one_b.time["bubble_fraction"]


def test_tp_comm_overlap_hides_behind_the_linear_layers_gemms_not_the_attention_kernel():
    # Transformer Engine's userbuffers pipeline each sequence-parallel all-gather with the
    # GEMM that reads its output and each reduce-scatter with the GEMM that writes its
    # input: the linear layers. On a link slow enough that the collectives outlast every
    # kernel, what is hidden is exactly those GEMMs' time, not the fused attention's.
    from dataclasses import replace

    from minipar.plan.kernels import stage_kernels
    from minipar.plan.layout import stage_plans
    from minipar.plan.timing import tp_overlap_hidden

    shape = presets.model("llama2-7b").with_seq_len(16384)  # attention: a third of it
    slow = replace(presets.cluster("h100"), intra_node_bandwidth=1e9)
    config = ParallelConfig(dp=1, tp=8, micro_batch_size=1, global_batch_size=8,
                            sequence_parallel=True, flash_attention=True,
                            tp_comm_overlap=True)
    stage = stage_plans(shape, config)[0]
    hidden = tp_overlap_hidden(shape, config, slow, stage)
    roofline = slow.roofline
    for kind in ("forward", "backward"):
        groups = stage_kernels(shape, config, stage)[kind]
        linear = sum(times * roofline.total_seconds(
            [k for k in kernels if k.gemm is not None and k.attention is None])
            for times, kernels in groups)
        attention = sum(times * roofline.total_seconds(
            [k for k in kernels if k.attention is not None]) for times, kernels in groups)
        assert attention > 0.2 * linear  # a kernel that would matter if it were counted
        assert hidden[kind] == pytest.approx(linear, rel=1e-12)


def test_hidden_data_parallel_traffic_slows_the_compute_beside_it():
    # timing.overlap_contention_seconds: contention x the traffic's rate as a share of
    # NVLink's x its hidden seconds, added to the compute; the emulator's clusters keep
    # overlap free, so the planner still matches the emulator there
    from dataclasses import replace

    shape = presets.model("llama2-7b")
    h100 = presets.cluster("h100")
    assert h100.overlap_contention > 0
    assert presets.cluster("emulated").overlap_contention == 0
    free = replace(h100, overlap_contention=0.0)

    def with_and_without(config):
        est, base = estimate(shape, config, h100), estimate(shape, config, free)
        hidden = data_parallel_seconds(shape, config, h100, stage_plan(shape, config, 0))
        return est, base, hidden["hidden_s"]

    inside = ParallelConfig(dp=8, zero=3, micro_batch_size=1, global_batch_size=16)
    est, base, hidden = with_and_without(inside)
    assert hidden > 0
    assert est.time["overlap_contention_s"] == pytest.approx(h100.overlap_contention * hidden)
    assert est.step_time == pytest.approx(base.step_time + est.time["overlap_contention_s"])
    assert base.time["overlap_contention_s"] == 0.0
    # across nodes with one member a node the ring moves bytes at one NIC's 50 GB/s:
    # a ninth of NVLink's rate, a ninth of the contention per hidden second
    across = ParallelConfig(dp=2, tp=8, zero=3, micro_batch_size=1, global_batch_size=16)
    est, base, hidden = with_and_without(across)
    assert est.time["overlap_contention_s"] == pytest.approx(
        h100.overlap_contention * hidden * 50 / 450)
    # no overlap, nothing hidden: nothing lost
    blocking = inside.replace(overlap_grad_reduce=False, zero3_prefetch=False)
    assert estimate(shape, blocking, h100).time["overlap_contention_s"] == 0.0


@pytest.mark.parametrize("exact", [True, False])
def test_a_pipelined_step_pays_the_contention_once_not_per_micro_batch(exact):
    # the simulated schedule adds each rank's contention after its last backward; the
    # closed form adds it to the step's tail: once, not (m + p - 1) / m times
    from dataclasses import replace

    shape, h100 = presets.model("llama2-7b"), presets.cluster("h100")
    config = ParallelConfig(dp=4, pp=2, zero=1, micro_batch_size=1, global_batch_size=64,
                            bucket_size_mb=25.0)
    est = estimate(shape, config, h100, exact_pipeline=exact)
    base = estimate(shape, config, replace(h100, overlap_contention=0.0),
                    exact_pipeline=exact)
    added = est.step_time - base.step_time
    # (at most the largest rank's: another stage may set the step)
    assert 0 < added <= est.time["overlap_contention_s"] * (1 + 1e-9)


