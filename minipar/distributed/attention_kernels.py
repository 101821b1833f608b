"""How fast a fused attention kernel runs: the measured rates a roofline prices it at.

A fused attention kernel (FlashAttention: Dao et al. 2022; FlashAttention-2: Dao 2023;
FlashAttention-3: Shah et al. 2024; cuDNN's flash attention) is not one GEMM. It runs
two products per key block with an online softmax between them on the CUDA cores, and
its backward recomputes the scores and runs four more products. How close it gets to the
tensor-core peak depends on the kernel, the pass, the mask, the head dim and the sequence
length: FlashAttention-2 "achieving only 35% utilization on the H100 GPU",
FlashAttention-3 up to 75% (Shah et al. 2024, abstract). So a roofline prices such a
kernel at its own measured rate, not at a GEMM's `gemm_efficiency`.

The rates: Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608), section 4.1, the BF16
bar charts "Attention forward speed, head dim 64 / 128 (H100 80GB SXM5)" without and with
the causal mask and "Attention backward speed, head dim 64 / 128 (H100 80GB SXM5)": 16K
tokens per batch (batch x seqlen), 2048 hidden, in TFLOP/s of the benchmark's own count
(minipar.autograd.kernels.FusedAttention), as the bars' labels read.

Where minipar goes beyond the measurements, and why:
- A causal backward is not in the charts: its rate is the backward's times the forward's
  causal / non-causal ratio at that length (the mask wastes the same diagonal tiles in
  both passes).
- Between the measured lengths the rate is interpolated linearly in log2(length);
  outside them it is the nearest measured one.
- A head dim is priced with the nearest measured one (in log2): 64 or 128. (The paper's
  256 runs faster still; minipar's presets use 64 and 128.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from minipar.autograd.kernels import FusedAttention

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)  # the charts' x axis


@dataclass(frozen=True)
class Rates:
    """One kernel's charts at one head dim: FLOP/s at each of SEQ_LENS forward without
    and with the causal mask, and backward without it."""

    forward: tuple[float, ...]
    forward_causal: tuple[float, ...]
    backward: tuple[float, ...]

    def __post_init__(self) -> None:
        for setting in ("forward", "forward_causal", "backward"):
            rates = getattr(self, setting)
            if len(rates) != len(SEQ_LENS) or not all(r > 0 for r in rates):
                raise ValueError(f"Rates.{setting} must hold one positive rate per sequence "
                                 f"length {SEQ_LENS}, got {rates}")

    def flops_per_second(self, work: FusedAttention) -> float:
        """The rate at which `work` (in its benchmark's count) runs."""
        def at(rates: tuple[float, ...]) -> float:
            return float(np.interp(np.log2(work.seq_len), np.log2(SEQ_LENS), rates))

        if not work.backward:
            return at(self.forward_causal if work.causal else self.forward)
        mask = at(self.forward_causal) / at(self.forward)
        return at(self.backward) * (mask if work.causal else 1.0)


@dataclass(frozen=True)
class AttentionKernel:
    """One fused attention kernel on one GPU: its Rates at each measured head dim."""

    name: str  # what a plan's JSON shows of it (its roofline's repr): the rates are data
    head_dims: tuple[tuple[int, Rates], ...] = field(repr=False)
    rate: str = field(default="measured rate", repr=False)  # how a plan names the rates

    def flops_per_second(self, work: FusedAttention) -> float:
        _, rates = min(self.head_dims,
                       key=lambda item: abs(math.log2(item[0] / work.head_dim)))
        return rates.flops_per_second(work)


def _tflops(*rates: float) -> tuple[float, ...]:
    return tuple(r * 1e12 for r in rates)


FLASH2_H100 = AttentionKernel("FlashAttention-2", (
    (64, Rates(forward=_tflops(282, 306, 318, 321, 322, 324),
               forward_causal=_tflops(180, 229, 262, 284, 295, 299),
               backward=_tflops(198, 238, 264, 279, 287, 291))),
    (128, Rates(forward=_tflops(309, 350, 362, 368, 370, 370),
                forward_causal=_tflops(191, 260, 298, 319, 333, 335),
                backward=_tflops(214, 260, 291, 310, 318, 322)))))
CUDNN_H100 = AttentionKernel("cuDNN", (
    (64, Rates(forward=_tflops(335, 373, 395, 408, 412, 413),
               forward_causal=_tflops(225, 288, 334, 363, 379, 388),
               backward=_tflops(266, 348, 395, 417, 432, 433))),
    (128, Rates(forward=_tflops(497, 574, 617, 609, 600, 595),
                forward_causal=_tflops(315, 410, 484, 518, 529, 539),
                backward=_tflops(305, 408, 465, 499, 518, 516)))))
FLASH3_H100 = AttentionKernel("FlashAttention-3", (
    (64, Rates(forward=_tflops(333, 392, 460, 476, 496, 497),
               forward_causal=_tflops(197, 265, 371, 420, 460, 473),
               backward=_tflops(272, 363, 422, 453, 472, 474))),
    (128, Rates(forward=_tflops(467, 565, 625, 638, 646, 648),
                forward_causal=_tflops(292, 423, 521, 579, 602, 616),
                backward=_tflops(316, 424, 501, 542, 559, 561)))))



def slower(kernel: AttentionKernel, name: str, forward: float, backward: float
           ) -> AttentionKernel:
    """`kernel` with every forward rate divided by `forward`, every backward one by
    `backward`: a kernel known only by how much slower than a measured one it runs."""
    def scale(rates: tuple[float, ...], by: float) -> tuple[float, ...]:
        return tuple(r / by for r in rates)

    return AttentionKernel(name, tuple(
        (head_dim, Rates(forward=scale(r.forward, forward),
                         forward_causal=scale(r.forward_causal, forward),
                         backward=scale(r.backward, backward)))
        for head_dim, r in kernel.head_dims),
        rate=f"rate derived from {kernel.name}'s {kernel.rate}")


# FlashAttention in Triton (Tri Dao's flash_attn_triton.py; llm-foundry's MPT runs it as
# attn_impl: triton, on the pre-MLIR Triton its setup.py pins, `triton_pre_mlir_sm90`) has
# no H100 chart. Dao 2023 (FlashAttention-2, section 4.1) measured it beside
# FlashAttention-2 on the A100: FlashAttention-2 "around 1.3-1.5x faster than
# FlashAttention in Triton in the forward pass and around 2x faster in the backward
# pass". Neither kernel uses Hopper's wgmma or TMA (pre-MLIR Triton and FlashAttention-2
# both issue Ampere's mma), so that gap is carried over to the H100: FlashAttention-2's
# H100 rates over 1.4 (the range's middle) forward and 2 backward. Derived, not measured.
TRITON_GAP = (1.4, 2.0)
FLASH_TRITON_H100 = slower(FLASH2_H100, "FlashAttention in Triton", *TRITON_GAP)

# The kernels measured on each GPU (by its roofline's name), as `--attention-kernel`
# names them ("triton" derived from flash2, above). "gemm" is no measurement: the kernel
# priced as one GEMM at the roofline's gemm_efficiency, the only choice on a GPU without
# measured kernels.
MEASURED = {"H100-SXM5-80GB": {"flash2": FLASH2_H100, "cudnn": CUDNN_H100,
                               "flash3": FLASH3_H100, "triton": FLASH_TRITON_H100}}
GEMM = "gemm"
