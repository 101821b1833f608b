"""Cluster presets carry the datasheet figures; the published BLOOM-176B layout fits."""

from __future__ import annotations

import pytest

from minipar.plan import presets
from minipar.plan.cluster import GIB
from minipar.plan.estimate import estimate


def test_cluster_presets_are_the_datasheets():
    a100, h100 = presets.cluster("a100-80gb"), presets.cluster("h100")
    assert a100.peak_flops == 312e12 and h100.peak_flops == 989e12  # dense BF16
    assert a100.intra_node_bandwidth == 600e9 / 2  # NVLink 3, bidirectional / 2
    assert h100.intra_node_bandwidth == 900e9 / 2  # NVLink 4
    assert a100.inter_node_bandwidth == 200e9 / 8  # 200 Gb/s HDR per GPU, in bytes
    assert h100.inter_node_bandwidth == 400e9 / 8  # 400 Gb/s NDR per GPU
    assert a100.memory_bytes == h100.memory_bytes == 80 * GIB
    assert 0 < a100.efficiency < 1 and 0 < h100.efficiency < 1  # stated assumption
    assert presets.cluster("a100", memory_gib=40).memory_bytes == 40 * GIB
    # Jean Zay (BLOOM's): the same GPUs and NVLink, 4 Omni-Path links of 100 Gb/s a node
    jean_zay = presets.cluster("jean-zay-a100")
    assert jean_zay.inter_node_bandwidth == 4 * 100e9 / 8 / 8
    assert jean_zay.host_memory_bytes == 512e9 / 8  # 512 GB of CPU memory a node
    assert jean_zay.roofline == a100.roofline
    assert (jean_zay.peak_flops, jean_zay.intra_node_bandwidth, jean_zay.memory_bytes) == (
        a100.peak_flops, a100.intra_node_bandwidth, a100.memory_bytes)


def test_unknown_presets_list_the_choices():
    with pytest.raises(KeyError, match="llama2-70b"):
        presets.model("llama3")
    with pytest.raises(KeyError, match="a100-80gb"):
        presets.cluster("v100")


def test_bloom_layout_is_the_published_one():
    shape, config, cluster = presets.bloom_example()
    assert (config.tp, config.pp, config.dp, config.zero) == (4, 12, 8, 1)
    assert config.world_size == 384 == 48 * cluster.gpus_per_node
    assert config.global_batch_size == 2048 == 2 * config.micro_batches * 8
    assert sum(config.layer_split) == shape.n_layer == 70


def test_bloom_memory_fits_on_its_a100s():
    shape, config, cluster = presets.bloom_example()
    est = estimate(shape, config, cluster, all_stages=True)
    assert est.fits
    # every rank: bf16 weights and grads of ~1/48 of 176B (TP 4 x PP 12), ZeRO-1 shards
    # the 12-byte optimizer state over DP 8
    share = shape.n_params / (4 * 12)
    paper = estimate(shape, config.replace(grad_accum_dtype="bf16"), cluster, all_stages=True)
    for stage in paper.stages:
        state = stage.memory["params"] + stage.memory["grads"] + stage.memory["optimizer"]
        assert state == pytest.approx((2 + 2 + 12 / 8) * share, rel=0.15)
    # and fp32 gradient buffers, the planner's default (DeepSpeed's bf16 optimizer
    # accumulates in fp32)
    for stage in est.stages:
        state = stage.memory["params"] + stage.memory["grads"] + stage.memory["optimizer"]
        assert state == pytest.approx((2 + 4 + 12 / 8) * share, rel=0.15)
    # Without activation checkpointing it would not (the reason BLOOM used it).
    assert not estimate(shape, config.replace(recompute_granularity=None), cluster).fits


def bigscience_tflops(shape, config, step_s: float) -> float:
    """TFLOP/s per GPU as Megatron-DeepSpeed logged them for BLOOM (bigscience-workshop's
    megatron/utils.py, throughput_calculator): 24 x 4 B s l h^2 (1 + s / 6h + V / 16lh),
    the factor 4 counting the recomputed forward."""
    h, s, l_, v = shape.d_model, shape.seq_len, shape.n_layer, shape.vocab_size
    flops = 24 * 4 * config.global_batch_size * s * l_ * h * h * (
        1 + s / (6 * h) + v / (16 * l_ * h))
    return flops / step_s / config.world_size / 1e12


def test_bloom_step_is_within_ten_percent_of_the_logged_one():
    # BigScience's log at full batch: 104.70 s per iteration, "TFLOPs: 149.77" (its
    # formula reproduces the figure from the time)
    shape, config, cluster = presets.bloom_example()
    assert bigscience_tflops(shape, config, presets.BLOOM_176B_STEP_S) == pytest.approx(
        149.77, abs=0.05)
    # Planned on the cluster it ran on (4 x 100 Gb/s Omni-Path a node); nothing was fitted
    # on this row (one logged iteration)
    step = estimate(shape, config, cluster).step_time
    assert step == pytest.approx(presets.BLOOM_176B_STEP_S, rel=0.10)
