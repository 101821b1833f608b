"""The planner's kernel list: its FLOPs are shapes.py's, and a toy run on a roofline
profile (`minipar train --device h100 / a100`) takes the time the planner predicts for it.

Stated tolerance for the time: 1%. The GEMMs and attention report the same kernels on
both sides (minipar.autograd.kernels); an elementwise op in the emulator reports the bytes
of its actual inputs and outputs (weights, statistics, masks included), the planner a
formula per op that keeps the (tokens x width) streams only: measured differences are
under 0.4% of a toy step.
"""

from __future__ import annotations

import pytest

from minipar import distributed as dist
from minipar.plan import presets
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.experts import moe_flops_delta
from minipar.plan.kernels import (
    attention_core_kernels,
    cross_entropy_bytes,
    embedding_kernels,
    head_kernels,
    head_weight_kernels,
    layer_kernels,
    layer_weight_kernels,
)
from minipar.plan.layout import ParallelConfig, stage_plans
from minipar.plan.shapes import ModelShape, from_train_config
from minipar.plan.timing import stage_seconds
from minipar.train import TrainConfig, train

TIME_TOLERANCE = 0.01
STEPS = 2
TINY = dict(n_layer=2, d_model=32, n_head=4, seq_len=16, data="synthetic", steps=STEPS)

SHAPES = [
    presets.model("gpt2"),
    presets.model("llama2-70b"),  # rope, swiglu, rmsnorm, no biases, GQA
    ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=96, seq_len=32, dropout=0.1),
]


def flops(kernels) -> float:
    return sum(k.flops for k in kernels)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, True)])
def test_kernel_flops_are_the_shapes_counts(shape, tp, sp):
    b = 2
    forward, backward = layer_kernels(shape, b, tp, sp)
    assert (flops(forward), flops(backward)) == pytest.approx(shape.layer_flops(b, tp, sp),
                                                              rel=1e-12)
    f, bw = embedding_kernels(shape, b, tp)
    assert (flops(f), flops(bw)) == pytest.approx(shape.embedding_flops(b, tp), rel=1e-12)
    f, bw = head_kernels(shape, b, tp, sp)
    assert (flops(f), flops(bw)) == pytest.approx(shape.head_flops(b, tp, sp), rel=1e-12)
    *_, weight = layer_weight_kernels(shape, b, tp, sp)
    assert flops(weight) == pytest.approx(shape.layer_weight_flops(b, tp, sp), rel=1e-12)
    *_, weight = head_weight_kernels(shape, b, tp, sp)
    assert flops(weight) == pytest.approx(shape.head_weight_flops(b, tp), rel=1e-12)
    flash_f, flash_b = layer_kernels(shape, b, tp, sp, flash_attention=True)
    # causal FlashAttention runs the products of the key blocks on and below the
    # diagonal only: the model's count less the skipped (s - 128) / 2s of them
    s, skipped = shape.seq_len, max(0.0, (shape.seq_len - 128) / (2 * shape.seq_len))
    products = 3 * 4 * b * shape.n_head // tp * s * s * shape.head_dim  # forward + back
    assert flops(flash_f) + flops(flash_b) == pytest.approx(
        flops(forward) + flops(backward) - skipped * products, rel=1e-12)


def test_recomputation_adds_the_forward_kernels_to_the_backward():
    shape = presets.model("gpt2")
    cluster = presets.cluster("a100")
    config = ParallelConfig(micro_batch_size=4)
    (stage,) = stage_plans(shape, config)
    plain = stage_seconds(shape, config, cluster, stage)
    recomputed = stage_seconds(shape, config.replace(recompute_granularity="full"),
                               cluster, stage)
    assert recomputed["forward"] == plain["forward"]
    layers_forward = shape.n_layer * cluster.roofline.total_seconds(
        layer_kernels(shape, 4, itemsize=2)[0])
    assert recomputed["backward"] == pytest.approx(plain["backward"] + layers_forward)
    (estimated,) = estimate(shape, config, cluster).stages
    assert estimated.time["micro_batch_compute_s"] == pytest.approx(
        plain["forward"] + plain["backward"])


def test_selective_recomputation_adds_the_attention_core_kernels_to_the_backward():
    shape = presets.model("gpt2")
    cluster = presets.cluster("a100")
    config = ParallelConfig(micro_batch_size=4)
    (stage,) = stage_plans(shape, config)
    plain = stage_seconds(shape, config, cluster, stage)
    selective = stage_seconds(shape, config.replace(recompute_granularity="selective"),
                              cluster, stage)
    core_forward, _ = attention_core_kernels(shape, 4, itemsize=2)
    assert selective["forward"] == plain["forward"]
    assert selective["backward"] == pytest.approx(
        plain["backward"] + shape.n_layer * cluster.roofline.total_seconds(core_forward))
    # the core is the part of the layer that grows with s^2: a fraction of its forward
    layer_forward = cluster.roofline.total_seconds(layer_kernels(shape, 4, itemsize=2)[0])
    assert 0 < cluster.roofline.total_seconds(core_forward) < 0.5 * layer_forward


def test_a_real_models_time_is_mostly_gemms_and_its_elementwise_ops_priced_by_bytes():
    shape, roof = presets.model("gpt3-175b"), presets.cluster("a100").roofline
    forward, _ = layer_kernels(shape, 1, tp=8)
    gemm = sum(roof.seconds(k) for k in forward if k.gemm is not None)
    other = [k for k in forward if k.gemm is None]
    assert 0.7 < gemm / roof.total_seconds(forward) < 0.95
    for kernel in other:  # memory-bound: the HBM roof
        assert roof.seconds(kernel) == pytest.approx(
            kernel.nbytes / (roof.hbm_bandwidth * roof.memory_efficiency))


PROFILE_GRID = [
    pytest.param(dict(micro_batch_size=2, grad_accum_steps=2), id="fp32 accum 2"),
    pytest.param(dict(precision="bf16-mixed", micro_batch_size=2), id="bf16"),
    pytest.param(dict(dropout=0.1, tie_embeddings=False, micro_batch_size=2),
                 id="dropout untied"),
    pytest.param(dict(recompute_granularity="full", micro_batch_size=2), id="checkpointing"),
    pytest.param(dict(recompute_granularity="selective", seq_len=64, micro_batch_size=2),
                 id="selective"),
    pytest.param(dict(recompute_granularity="full", recompute_method="block",
                      recompute_num_layers=1, tp=2, micro_batch_size=2), id="tp2 block 1"),
    pytest.param(dict(tp=2, micro_batch_size=2), id="tp2"),
    pytest.param(dict(dp=2, zero=1, micro_batch_size=2), id="dp2 zero1"),
    pytest.param(dict(pp=2, n_layer=4, micro_batch_size=2, grad_accum_steps=4), id="pp2"),
    pytest.param(dict(pp=2, n_layer=4, micro_batch_size=2, grad_accum_steps=4,
                      schedule="zb-h1"), id="pp2 zb-h1"),
]


@pytest.mark.parametrize("profile", [dist.A100, dist.H100], ids=["a100", "h100"])
@pytest.mark.parametrize("settings", PROFILE_GRID)
def test_a_toy_run_on_a_roofline_profile_takes_the_planned_time(profile, settings):
    config = TrainConfig(**{**TINY, **settings})
    report = train(config, device=profile)
    shape = from_train_config(config, report.config["vocab_size"])
    cluster = ClusterSpec.from_device_profile(profile)
    est = estimate(shape, ParallelConfig.from_train_config(config), cluster, all_stages=True)
    for stage in est.stages:
        (measured,) = [r for r in report.ranks
                       if r["coords"] == {"dp": 0, "pp": stage.rank, "tp": 0}]
        spent = sum(measured["time"][k] for k in ("compute_s", "comm_s", "idle_s"))
        assert spent == pytest.approx(STEPS * est.step_time, rel=TIME_TOLERANCE)
    # and the roofline is what priced it: the uniform profile's time differs
    uniform = train(config)
    busy = ("compute_s", "comm_s", "idle_s")
    assert sum(uniform.ranks[0]["time"][k] for k in busy) != pytest.approx(
        sum(report.ranks[0]["time"][k] for k in busy), rel=0.1)


MOE_SHAPES = [
    presets.model("mixtral-8x7b").with_seq_len(512),  # SwiGLU experts, no biases
    ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=96, seq_len=32, moe_num_experts=4,
               moe_top_k=2, moe_capacity_factor=1.25, dropout=0.1),
]


@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (2, 4)])
def test_moe_layer_kernel_flops_are_the_experts_counts(shape, tp, ep):
    b = 2
    forward, backward = layer_kernels(shape, b, tp, moe_ep=ep)
    dense, delta = shape.layer_flops(b, tp), moe_flops_delta(shape, b, tp)
    assert (flops(forward), flops(backward)) == pytest.approx(
        (dense[0] + delta[0], dense[1] + delta[1]), rel=1e-12)


@pytest.mark.parametrize("recompute", [
    {},
    # layer 0 (MoE) is recomputed, layer 2 (MoE too) is not: one MoE forward again
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
], ids=["no recomputation", "block 1"])
@pytest.mark.parametrize("profile", [dist.H100], ids=["h100"])
def test_an_moe_toy_run_on_a_roofline_profile_takes_the_planned_time(profile, recompute):
    config = TrainConfig(**{**TINY, "n_layer": 3}, dp=2, ep=2, moe_num_experts=4,
                         moe_top_k=2, moe_capacity_factor=1.25, moe_layer_freq=2,
                         micro_batch_size=2, grad_clip=0.0, **recompute)
    report = train(config, device=profile)
    shape = from_train_config(config, report.config["vocab_size"])
    est = estimate(shape, ParallelConfig.from_train_config(config),
                   ClusterSpec.from_device_profile(profile))
    spent = sum(report.ranks[0]["time"][k] for k in ("compute_s", "comm_s", "idle_s"))
    assert spent == pytest.approx(STEPS * est.step_time, rel=TIME_TOLERANCE)


def test_megatrons_unfused_loss_moves_six_and_a_half_times_the_bytes_per_logit():
    # vocab_parallel_cross_entropy in fp32, op by op (kernels.cross_entropy_bytes): cast
    # 2 + 4, max 4, subtract 8, exp 8, sum 4, divide 8; backward scale 8, cast 4 + 2
    assert cross_entropy_bytes(2, fused=True) == (4, 4)
    assert cross_entropy_bytes(2, fused=False) == (38, 14)
    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=1000, seq_len=32)
    fused, unfused = (head_kernels(shape, 2, fused_loss=f) for f in (True, False))
    logits = 2 * 32 * 1000
    assert unfused[0][-1].nbytes - fused[0][-1].nbytes == 34 * logits
    assert unfused[1][0].nbytes - fused[1][0].nbytes == 10 * logits
    assert [k.flops for k in unfused[0]] == [k.flops for k in fused[0]]  # the same math
