"""What one kernel costs on a GPU: a roofline with the GEMM's shape in it.

A kernel does `flops` arithmetic and moves `nbytes` between HBM and the chip. It takes the
longer of the two (the roofline model, Williams, Waterman & Patterson 2009):

    seconds = max(flops / compute rate, nbytes / (hbm_bandwidth x memory_efficiency))

The compute rate depends on the unit the kernel runs on:

- A matrix multiply (`gemm=(batch, m, n, k)`: batch products of (m, k) @ (k, n)) runs on
  the tensor cores at `peak_flops x gemm_efficiency x shape_efficiency(m, n, batch)`.
  cuBLAS cuts the (m, n) output into tiles, one thread block per tile, and runs them in
  waves of one tile per SM. The tiles of the last wave that are missing, and the part of
  a tile hanging past the matrix's edge, compute nothing: that is "tile quantization"
  and "wave quantization" (NVIDIA, Matrix Multiplication Background User's Guide,
  sections 5.1-5.2). So

      shape_efficiency = (batch m n) / (waves x sm_count x tile_m x tile_n),
      waves = ceil(tiles / sm_count),  tiles = batch ceil(m / tile_m) ceil(n / tile_n).

  A large GEMM fills its waves (shape_efficiency -> 1) and runs at `gemm_efficiency` of
  peak; a small one (fewer tiles than SMs) leaves most of the chip idle; a skinny one
  (one small dimension, e.g. attention's k = head_dim) has little arithmetic per byte
  and lands on the memory roof instead.
- A fused attention kernel (`Kernel.attention`: FlashAttention, cuDNN's) runs at its own
  measured rate when the roofline has one (`attention`: see
  minipar.distributed.attention_kernels), else as the GEMM of its shape.
- An FP8 GEMM (`Kernel.fp8`: Transformer Engine's FP8 linear layers, priced by the
  planner) runs on the same tensor cores at their FP8 rate, `fp8_peak_flops x
  fp8_gemm_efficiency x shape_efficiency`: twice the 16-bit peak on Hopper, with its own
  fitted efficiency. A roofline without an FP8 rate (the A100's) cannot price one.
- Everything else (norms, activations, softmax, dropout, residual adds, the optimizer)
  runs on the CUDA cores at `vector_flops`; these kernels move a few bytes per FLOP, so
  the memory roof prices them: bytes moved at HBM bandwidth.

What minipar leaves out, and why: cuBLAS picks smaller tiles for small problems (we keep
one tile shape, so tiny GEMMs are priced pessimistically), kernel launch latency (a few
microseconds, a rounding error for the models a planner sizes, dominant for toy ones),
and caches (a kernel's operands are assumed to come from HBM once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from minipar.autograd.kernels import Kernel
from minipar.distributed.attention_kernels import AttentionKernel

# A kernel list this long is priced by distinct object (Roofline.total_seconds): an op's
# kernels are a few, and the dict would cost them more than it saves.
LONG_KERNEL_LIST = 64


@dataclass(frozen=True)
class Roofline:
    """A GPU as two roofs and a tile grid.

    peak_flops: dense 16-bit tensor-core FLOP/s (datasheet).
    vector_flops: FLOP/s of the CUDA cores for elementwise work (datasheet, FP32 non-tensor).
    hbm_bandwidth: bytes/s of device memory (datasheet).
    gemm_efficiency: the fraction of peak a large, well-shaped GEMM sustains (cuBLAS
        microbenchmarks; fitted in benchmarks/fit_time_model.py).
    memory_efficiency: the fraction of hbm_bandwidth a streaming kernel sustains
        (STREAM-like microbenchmarks; fitted alongside).
    sm_count: streaming multiprocessors (datasheet). tile: (rows, columns) of the output
        tile one thread block computes (cuBLAS's large fp16 tiles, 256 x 128).
    attention: the fused attention kernel's measured rates (None: priced as a GEMM).
    fp8_peak_flops: dense FP8 tensor-core FLOP/s (datasheet; None: the GPU has no FP8
        tensor cores). fp8_gemm_efficiency: the fraction of it a large FP8 GEMM sustains
        in a training step (fitted in benchmarks/fit_time_model.py).
    """

    name: str
    peak_flops: float
    vector_flops: float
    hbm_bandwidth: float
    gemm_efficiency: float
    memory_efficiency: float
    sm_count: int
    tile: tuple[int, int] = (256, 128)
    attention: AttentionKernel | None = None
    fp8_peak_flops: float | None = None
    fp8_gemm_efficiency: float | None = None

    def __post_init__(self) -> None:
        for setting in ("peak_flops", "vector_flops", "hbm_bandwidth"):
            if not getattr(self, setting) > 0:
                raise ValueError(f"Roofline.{setting} must be > 0, got {getattr(self, setting)}")
        if (self.fp8_peak_flops is None) != (self.fp8_gemm_efficiency is None):
            raise ValueError("Roofline: give fp8_peak_flops and fp8_gemm_efficiency "
                             "together, or neither")
        if self.fp8_peak_flops is not None and not self.fp8_peak_flops > 0:
            raise ValueError(f"Roofline.fp8_peak_flops must be > 0, got "
                             f"{self.fp8_peak_flops}")
        efficiencies = ["gemm_efficiency", "memory_efficiency"]
        if self.fp8_gemm_efficiency is not None:
            efficiencies.append("fp8_gemm_efficiency")
        for setting in efficiencies:
            if not 0 < getattr(self, setting) <= 1:
                raise ValueError(f"Roofline.{setting} must be in (0, 1], got "
                                 f"{getattr(self, setting)}")
        if not isinstance(self.sm_count, int) or self.sm_count < 1:
            raise ValueError(f"Roofline.sm_count must be a positive integer, got "
                             f"{self.sm_count!r}")

    def shape_efficiency(self, batch: int, m: int, n: int) -> float:
        """The share of the tile slots of its waves a GEMM's output fills (0, 1]."""
        tile_m, tile_n = self.tile
        tiles = batch * math.ceil(m / tile_m) * math.ceil(n / tile_n)
        waves = math.ceil(tiles / self.sm_count)
        return batch * m * n / (waves * self.sm_count * tile_m * tile_n)

    @property
    def has_fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores (and so can price an FP8 GEMM)."""
        return self.fp8_peak_flops is not None

    def gemm_flops(self, batch: int, m: int, n: int, fp8: bool = False) -> float:
        """FLOP/s a GEMM with a (batch, m, n) output sustains when compute-bound (fp8: on
        the FP8 tensor cores)."""
        if fp8:
            if not self.has_fp8:
                raise ValueError(f"{self.name} has no FP8 tensor cores")
            rate = self.fp8_peak_flops * self.fp8_gemm_efficiency
        else:
            rate = self.peak_flops * self.gemm_efficiency
        return rate * self.shape_efficiency(batch, m, n)

    def seconds(self, kernel: Kernel) -> float:
        """Seconds of one kernel: the higher of its compute time and its memory time."""
        if kernel.attention is not None and self.attention is not None:
            compute = kernel.attention.flops / self.attention.flops_per_second(
                kernel.attention)
        elif kernel.gemm is not None:
            batch, m, n, _ = kernel.gemm
            compute = kernel.flops / self.gemm_flops(batch, m, n, kernel.fp8)
        else:
            compute = kernel.flops / self.vector_flops
        memory = kernel.nbytes / (self.hbm_bandwidth * self.memory_efficiency)
        return max(compute, memory)

    def total_seconds(self, kernels) -> float:
        """Seconds of the kernels run one after another. A long list (an MoE layer's
        experts, each the same kernels) prices each distinct object once: the same sum."""
        if len(kernels) < LONG_KERNEL_LIST:
            return sum(self.seconds(k) for k in kernels)
        priced: dict[int, float] = {}
        return sum(priced[id(k)] if id(k) in priced else priced.setdefault(id(k), self.seconds(k))
                   for k in kernels)

    def replace(self, **changes) -> Roofline:
        return replace(self, **changes)


# Datasheet figures (dense, no sparsity): NVIDIA A100 Tensor Core GPU datasheet and
# architecture white paper (A100 SXM4 80GB: 312 TFLOP/s BF16/FP16 tensor, 19.5 TFLOP/s
# FP32, 2039 GB/s HBM2e, 108 SMs); NVIDIA H100 datasheet and Hopper white paper (H100 SXM5:
# 989 TFLOP/s BF16 tensor, 67 TFLOP/s FP32, 3.35 TB/s HBM3, 132 SMs). The two efficiencies
# are fitted on Narayanan et al. 2021, Table 1 (benchmarks/fit_time_model.py prints the
# fit and its residuals: 0.70 and 0.65). Both land below what microbenchmarks of a single
# kernel reach (cuBLAS ~80% of the A100's FP16 peak on large GEMMs, STREAM-like copies
# ~85-90% of HBM bandwidth) because the table is end to end ("includes all operations
# including data loading, optimization, and even logging": Megatron-LM's README) and the
# model leaves things out: gaps between kernels, NCCL below the link rate, the
# optimizer's extra passes (loss scaling, gradient norm). The H100's two are fitted the
# same way on five of the H100 runs of Megatron-LM's README model table and held against
# the four others and the Llama 3 paper's Table 4 (minipar/plan/published_h100.py;
# benchmarks/fit_time_model.py): 0.69 and 0.28. The low HBM figure is not a bandwidth:
# it prices Megatron-Core's many small elementwise kernels of 2024 (launch gaps, TE's
# unfused paths) that the kernel list counts as single streaming passes.
GEMM_EFFICIENCY = 0.70
MEMORY_EFFICIENCY = 0.65
H100_GEMM_EFFICIENCY = 0.69
H100_MEMORY_EFFICIENCY = 0.28
# The H100's FP8 tensor cores: 1979 TFLOP/s dense (datasheet), and the fraction of it the
# layers' FP8 GEMMs sustain in a training step, fitted on NVIDIA's FP8 runs of DGX Cloud
# Benchmarking v24.11.1 (minipar/plan/published_dgxc.py; benchmarks/fit_time_model.py),
# held out on those of its later releases.
H100_FP8_PEAK_FLOPS = 1979e12
H100_FP8_GEMM_EFFICIENCY = 0.60

A100_SXM_80GB = Roofline(name="A100-SXM4-80GB", peak_flops=312e12, vector_flops=19.5e12,
                         hbm_bandwidth=2039e9, gemm_efficiency=GEMM_EFFICIENCY,
                         memory_efficiency=MEMORY_EFFICIENCY, sm_count=108)
H100_SXM_80GB = Roofline(name="H100-SXM5-80GB", peak_flops=989e12, vector_flops=67e12,
                         hbm_bandwidth=3.35e12, gemm_efficiency=H100_GEMM_EFFICIENCY,
                         memory_efficiency=H100_MEMORY_EFFICIENCY, sm_count=132,
                         fp8_peak_flops=H100_FP8_PEAK_FLOPS,
                         fp8_gemm_efficiency=H100_FP8_GEMM_EFFICIENCY)
