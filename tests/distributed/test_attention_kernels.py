"""A fused attention kernel on the roofline: priced at its measured rate (Shah et al. 2024's
H100 charts), as a GEMM where a GPU has no measurement; the work it is priced by is its
benchmarks' count."""

from __future__ import annotations

import pytest

from minipar.autograd.kernels import FusedAttention, Kernel, ring_attention_block_kernels
from minipar.distributed.attention_kernels import (
    CUDNN_H100,
    FLASH2_H100,
    FLASH3_H100,
    Rates,
)
from minipar.distributed.roofline import H100_SXM_80GB
from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.kernels import layer_kernels
from minipar.plan.layout import ParallelConfig

PEAK = H100_SXM_80GB.peak_flops


def test_the_rates_are_the_papers_headline_utilizations():
    # "FlashAttention-2 achieving only 35% utilization on the H100 GPU" and FlashAttention-3
    # "up to 740 TFLOPs/s (75% utilization)" with FP16 (Shah et al. 2024, abstract; the
    # 740 is head dim 256, so head dim 128's best stays below it)
    flash2, flash3 = dict(FLASH2_H100.head_dims), dict(FLASH3_H100.head_dims)
    assert max(flash2[128].forward) / PEAK == pytest.approx(0.35, abs=0.03)
    assert max(flash3[128].forward) < 740e12
    for kernel in (FLASH2_H100, CUDNN_H100, FLASH3_H100):
        rates = dict(kernel.head_dims)
        for r in rates.values():  # the mask costs rate, forward, at every length
            assert all(c < f for c, f in zip(r.forward_causal, r.forward, strict=True))
        # a 128-wide head keeps the tensor cores busier than a 64-wide one (16K tokens)
        assert rates[128].forward[-1] > rates[64].forward[-1]


def compute_bound(work: FusedAttention) -> Kernel:
    return Kernel(flops=0.8 * work.flops, nbytes=1.0, gemm=(16, work.seq_len, work.head_dim,
                                                             work.seq_len), attention=work)


def test_a_fused_kernel_runs_at_its_measured_rate_on_a_roofline_that_has_one():
    roof = H100_SXM_80GB.replace(attention=CUDNN_H100)
    forward = FusedAttention(backward=False, causal=True, seq_len=8192, head_dim=128, flops=1e12)
    assert roof.seconds(compute_bound(forward)) == pytest.approx(1e12 / 529e12)
    # between two measured lengths: linear in log2(length)
    between = FusedAttention(False, False, 4096 * 2**0.5, 128, 1e12)
    assert roof.seconds(compute_bound(between)) == pytest.approx(1e12 / ((609e12 + 600e12) / 2))
    # beyond the charts: the nearest measured length
    long = FusedAttention(False, False, 131072, 128, 1e12)
    assert roof.seconds(compute_bound(long)) == pytest.approx(1e12 / 595e12)
    # a causal backward: the backward's rate times the forward's causal / full ratio
    backward = FusedAttention(True, True, 8192, 128, 1e12)
    assert roof.seconds(compute_bound(backward)) == pytest.approx(
        1e12 / (518e12 * 529 / 600))
    # a head dim between the measured ones: the nearest (80 -> 64, 112 -> 128)
    assert roof.seconds(compute_bound(FusedAttention(False, True, 8192, 80, 1e12))) == (
        pytest.approx(1e12 / 379e12))
    assert roof.seconds(compute_bound(FusedAttention(False, True, 8192, 112, 1e12))) == (
        pytest.approx(1e12 / 529e12))


def test_without_measured_rates_a_fused_kernel_is_priced_as_the_gemm_of_its_shape():
    work = FusedAttention(False, True, 8192, 128, 1e12)
    kernel = compute_bound(work)
    plain = Kernel(kernel.flops, kernel.nbytes, kernel.gemm)
    assert H100_SXM_80GB.attention is None
    assert H100_SXM_80GB.seconds(kernel) == H100_SXM_80GB.seconds(plain)


def test_bad_attention_kernel_rates_are_one_line_errors():
    with pytest.raises(ValueError, match="Rates.backward must hold one positive"):
        Rates(forward=(1.0,) * 6, forward_causal=(1.0,) * 6, backward=(1.0,))
    with pytest.raises(ValueError, match="Rates.forward must hold"):
        Rates(forward=(0.0,) * 6, forward_causal=(1.0,) * 6, backward=(1.0,) * 6)


def test_the_kernels_count_their_work_as_flash_attentions_benchmarks_do():
    # flash-attention's benchmarks/benchmark_flash_attention.py: 4 b s^2 h d forward,
    # halved when causal, 2.5 times that backward
    shape = presets.model("llama2-7b")
    b, tp, s, d = 2, 2, shape.seq_len, shape.head_dim
    heads = b * shape.n_head // tp
    forward, backward = layer_kernels(shape, b, tp, flash_attention=True)
    (fwd,) = [k.attention for k in forward if k.attention is not None]
    (bwd,) = [k.attention for k in backward if k.attention is not None]
    assert (fwd.backward, fwd.causal, fwd.seq_len, fwd.head_dim) == (False, True, s, d)
    assert fwd.flops == 4 * heads * s * s * d / 2
    assert (bwd.backward, bwd.causal) == (True, True) and bwd.flops == 2.5 * fwd.flops
    # a ring attention chunk pair (context parallelism) is a full c x c block
    (pf,), (pb,) = ring_attention_block_kernels(heads, 1024, d, 2, flash=True)
    assert not pf.attention.causal and pf.attention.flops == 4 * heads * 1024**2 * d
    assert pb.attention.flops == 2.5 * pf.attention.flops
    # unfused attention is GEMMs and elementwise kernels: nothing priced as fused
    plain_f, plain_b = layer_kernels(shape, b, tp, flash_attention=False)
    assert all(k.attention is None for k in plain_f + plain_b)


def test_a_plans_step_follows_the_measured_kernels_and_the_emulator_profile_has_none():
    shape, h100 = presets.model("llama2-7b"), presets.cluster("h100")
    config = ParallelConfig(dp=8, micro_batch_size=1, global_batch_size=64,
                            flash_attention=True)
    step = {name: estimate(shape, config, h100.with_attention_kernel(name)).step_time
            for name in ("flash2", "cudnn", "flash3", "gemm")}
    assert step["flash2"] > step["cudnn"] > step["flash3"] > step["gemm"]
    assert estimate(shape, config, h100).step_time == step["cudnn"]  # the preset's default
    # the emulator runs no fused attention: its profile's clusters price none
    assert presets.cluster("emulated-h100").roofline.attention is None


def test_the_triton_kernel_is_flash2_over_dao_2023s_a100_gap():
    # FlashAttention-2 "around 1.3-1.5x faster than FlashAttention in Triton in the
    # forward pass and around 2x faster in the backward pass" (Dao 2023, section 4.1):
    # the Triton kernel's rates are FlashAttention-2's H100 ones over 1.4 and 2
    from minipar.distributed.attention_kernels import FLASH_TRITON_H100, MEASURED

    assert MEASURED["H100-SXM5-80GB"]["triton"] is FLASH_TRITON_H100
    for seq in (512, 2048, 65536):
        for causal in (False, True):
            forward = FusedAttention(False, causal, seq, 128, 1.0)
            backward = FusedAttention(True, causal, seq, 128, 1.0)
            assert (FLASH_TRITON_H100.flops_per_second(forward) * 1.4
                    == pytest.approx(FLASH2_H100.flops_per_second(forward), rel=1e-12))
            assert (FLASH_TRITON_H100.flops_per_second(backward) * 2
                    == pytest.approx(FLASH2_H100.flops_per_second(backward), rel=1e-12))
    # and a plan says the rate is derived, not measured
    from minipar.plan.estimate import compute_model

    text = compute_model(presets.cluster("h100").with_attention_kernel("triton"))
    assert "FlashAttention in Triton's rate derived from FlashAttention-2's measured" in text
    assert "cuDNN's measured rate" in compute_model(presets.cluster("h100"))
