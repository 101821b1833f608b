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


def test_bloom_memory_fits_on_a100_80gb():
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


def test_bloom_throughput_is_in_the_published_range():
    # BigScience reported "about 150 TFLOPs" per A100 (hardware FLOPs: the
    # recomputation's extra forward counts).
    shape, config, cluster = presets.bloom_example()
    est = estimate(shape, config, cluster)
    achieved = est.time["model_flops"] * 4 / 3 / est.step_time / config.world_size  # +recompute
    assert 120e12 < achieved < 180e12
