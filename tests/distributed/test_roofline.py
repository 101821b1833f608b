"""The roofline: a GEMM runs at its shape's share of the tensor-core roof or on the
memory roof, an elementwise kernel at the bytes it moves; uniform profiles stay uniform."""

from __future__ import annotations

import pytest

from minipar import distributed as dist
from minipar.autograd.kernels import Kernel, gemm_kernel, linear_backward_kernels
from minipar.distributed.roofline import A100_SXM_80GB, Roofline

ROOF = Roofline(name="test", peak_flops=100e12, vector_flops=10e12, hbm_bandwidth=1e12,
                gemm_efficiency=0.5, memory_efficiency=0.8, sm_count=4, tile=(128, 64))


def test_a_gemm_that_fills_whole_waves_runs_at_gemm_efficiency_of_peak():
    # 4 SMs x (128 x 64) tiles: (256, 128) is exactly one wave; k large => compute-bound
    kernel = gemm_kernel(1, 256, 128, 8192, itemsize=2)
    assert ROOF.shape_efficiency(1, 256, 128) == 1.0
    assert ROOF.seconds(kernel) == pytest.approx(kernel.flops / (0.5 * 100e12))


def test_wave_and_tile_quantization_waste_the_missing_tiles():
    # one tile on 4 SMs: 3 idle SMs
    assert ROOF.shape_efficiency(1, 128, 64) == pytest.approx(1 / 4)
    # 5 tiles: two waves of 4 slots, 5 of 8 used
    assert ROOF.shape_efficiency(5, 128, 64) == pytest.approx(5 / 8)
    # a 129-row output needs a second row of tiles, mostly empty
    assert ROOF.shape_efficiency(1, 129, 64) == pytest.approx(129 * 64 / (4 * 128 * 64))
    kernel = gemm_kernel(1, 128, 64, 1 << 16, itemsize=2)
    assert ROOF.seconds(kernel) == pytest.approx(kernel.flops / (0.5 * 100e12 / 4))


def test_a_skinny_gemm_lands_on_the_memory_roof():
    # k = 1: 2 FLOPs per output element, 2 bytes written per element: memory-bound
    kernel = gemm_kernel(4, 1024, 1024, 1, itemsize=2)
    memory = kernel.nbytes / (0.8 * 1e12)
    assert ROOF.seconds(kernel) == pytest.approx(memory)
    assert memory > kernel.flops / ROOF.gemm_flops(4, 1024, 1024)


def test_elementwise_kernels_cost_their_bytes_at_hbm_bandwidth():
    kernel = Kernel(flops=8 * 1e6, nbytes=4 * 1e6)  # a LayerNorm of 1M bf16 elements
    assert ROOF.seconds(kernel) == pytest.approx(4e6 / 0.8e12)
    compute_bound = Kernel(flops=1e9, nbytes=1.0)  # no bytes: the CUDA cores' rate
    assert ROOF.seconds(compute_bound) == pytest.approx(1e9 / 10e12)


def test_a_linear_layers_backward_is_two_gemms_of_the_forwards_flops():
    forward = gemm_kernel(1, 512, 256, 128, itemsize=2)
    dgrad, wgrad = linear_backward_kernels(1, 512, 256, 128, itemsize=2)
    assert dgrad.flops == wgrad.flops == forward.flops
    assert dgrad.gemm == (1, 512, 128, 256) and wgrad.gemm == (1, 128, 256, 512)
    assert dgrad.nbytes == wgrad.nbytes == forward.nbytes  # the same three matrices


def test_large_a100_gemms_sustain_the_fitted_efficiency_and_attention_less():
    big = gemm_kernel(1, 8192, 8192, 8192, itemsize=2)
    rate = big.flops / A100_SXM_80GB.seconds(big)
    assert rate == pytest.approx(312e12 * A100_SXM_80GB.gemm_efficiency, rel=0.01)
    scores = gemm_kernel(64, 2048, 2048, 128, itemsize=2)  # q k^T, head_dim 128
    assert scores.flops / A100_SXM_80GB.seconds(scores) < 0.8 * rate


def test_bad_roofline_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="gemm_efficiency"):
        ROOF.replace(gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="sm_count"):
        ROOF.replace(sm_count=0)
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        ROOF.replace(hbm_bandwidth=0)


def test_profiles_without_a_roofline_price_flops_uniformly():
    uniform = dist.DeviceProfile(flops=1e12)
    kernels = [gemm_kernel(1, 8, 8, 8, itemsize=4)]
    assert uniform.compute_seconds(1e9, kernels) == 1e-3  # kernels ignored
    assert dist.A100.compute_seconds(1e9, kernels) == A100_SXM_80GB.total_seconds(kernels)
    assert dist.A100.compute_seconds(1e9) == 1e9 / dist.A100.flops  # no kernels reported


def test_only_roofline_devices_ask_ops_for_kernels():
    def worker():
        return dist.get_device().wants_kernels

    assert dist.launch(worker, 1) == [False]
    assert dist.launch(worker, 1, device=dist.H100) == [True]
