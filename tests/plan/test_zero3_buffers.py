"""ZeRO-3's backward buffers at scale: one layer's worth, however deep the model (the
emulator's order, checked byte for byte at 8 layers in test_estimate.py's GRID)."""

from __future__ import annotations

from dataclasses import replace

from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig

LLAMA_70B_ON_64 = ParallelConfig(dp=64, zero=3, micro_batch_size=1, global_batch_size=1024,
                                 recompute_granularity="full", flash_attention=True)


def buffers(n_layer: int, **changes) -> int:
    shape = replace(presets.model("llama2-70b"), n_layer=n_layer)
    est = estimate(shape, LLAMA_70B_ON_64.replace(**changes), presets.cluster("h100"))
    return est.stages[0].memory["detail"]["sync_buffers"]


def test_the_buffers_do_not_grow_with_depth():
    assert buffers(20) == buffers(40) == buffers(80)


def test_the_70b_example_fits_with_about_one_layers_buffers():
    """Llama-2 70B over 64 ranks: a layer's bf16 parameters gathered and prefetched, its
    fp32 gradients and two fp32 flat copies in flight (16 bytes per layer parameter),
    plus the piece added into the shard under accumulation."""
    shape = presets.model("llama2-70b")
    est = estimate(shape, LLAMA_70B_ON_64, presets.cluster("h100"))
    layer = sum(shape.layer_params(1))
    assert est.fits
    assert buffers(80) == 16 * layer + 4 * -(-layer // 64)


def test_waiting_for_each_reduce_scatter_keeps_no_flat_copy_in_flight():
    """Without overlap: the layer's gathered and prefetched bf16 parameters, its fp32
    gradients and their flat copy while it is reduced, 12 bytes per layer parameter."""
    layer = sum(presets.model("llama2-70b").layer_params(1))
    assert buffers(80, overlap_grad_reduce=False) == 12 * layer
