"""How fast a fused attention kernel runs: the measured rates a roofline prices it at.

A fused attention kernel (FlashAttention: Dao et al. 2022; FlashAttention-2: Dao 2023;
FlashAttention-3: Shah et al. 2024; cuDNN's flash attention) is not one GEMM. It runs
two products per key block with an online softmax between them on the CUDA cores, and
its backward recomputes the scores and runs four more products. How close it gets to the
tensor-core peak depends on the kernel, the pass, the mask and the sequence length:
FlashAttention-2 "achieving only 35% utilization on the H100 GPU", FlashAttention-3 up
to 75% (Shah et al. 2024, abstract). So a roofline prices such a kernel at its own
measured rate, not at a GEMM's `gemm_efficiency`.

The rates: Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608), section 4.1, the bar
charts "Attention forward speed, head dim 128 (H100 80GB SXM5)" without and with the
causal mask and "Attention backward speed, head dim 128 (H100 80GB SXM5)": BF16, 16K
tokens per batch (batch x seqlen), 2048 hidden (16 heads of 128), in TFLOP/s of the
benchmark's own count (minipar.autograd.kernels.FusedAttention).

Where minipar goes beyond the measurements, and why:
- A causal backward is not in the charts: its rate is the backward's times the forward's
  causal / non-causal ratio at that length (the mask wastes the same diagonal tiles in
  both passes).
- Between the measured lengths the rate is interpolated linearly in log2(length);
  outside them it is the nearest measured one.
- Head dims other than 128 use the 128 figures (the paper's 64 run slower, 256 faster).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minipar.autograd.kernels import FusedAttention

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)  # the charts' x axis


@dataclass(frozen=True)
class AttentionKernel:
    """One fused attention kernel on one GPU: FLOP/s at each of `seq_lens` forward
    without and with the causal mask, and backward without it."""

    name: str  # what a plan's JSON shows of it (its roofline's repr): the rates are data
    forward: tuple[float, ...] = field(repr=False)
    forward_causal: tuple[float, ...] = field(repr=False)
    backward: tuple[float, ...] = field(repr=False)
    seq_lens: tuple[int, ...] = field(default=SEQ_LENS, repr=False)

    def __post_init__(self) -> None:
        for setting in ("forward", "forward_causal", "backward"):
            rates = getattr(self, setting)
            if len(rates) != len(self.seq_lens) or not all(r > 0 for r in rates):
                raise ValueError(f"AttentionKernel.{setting} must hold one positive rate per "
                                 f"sequence length {self.seq_lens}, got {rates}")

    def _at(self, rates: tuple[float, ...], seq_len: int) -> float:
        return float(np.interp(np.log2(seq_len), np.log2(self.seq_lens), rates))

    def flops_per_second(self, work: FusedAttention) -> float:
        """The rate at which this kernel runs `work` (in its benchmark's count)."""
        s = work.seq_len
        if not work.backward:
            return self._at(self.forward_causal if work.causal else self.forward, s)
        mask = self._at(self.forward_causal, s) / self._at(self.forward, s)
        return self._at(self.backward, s) * (mask if work.causal else 1.0)


def _tflops(*rates: float) -> tuple[float, ...]:
    return tuple(r * 1e12 for r in rates)


FLASH2_H100 = AttentionKernel(
    "FlashAttention-2", forward=_tflops(309, 350, 362, 368, 370, 370),
    forward_causal=_tflops(191, 260, 298, 319, 333, 335),
    backward=_tflops(214, 260, 291, 310, 318, 322))
CUDNN_H100 = AttentionKernel(
    "cuDNN", forward=_tflops(497, 574, 617, 609, 600, 595),
    forward_causal=_tflops(315, 410, 484, 518, 529, 539),
    backward=_tflops(305, 408, 465, 499, 518, 516))
FLASH3_H100 = AttentionKernel(
    "FlashAttention-3", forward=_tflops(467, 565, 625, 638, 646, 648),
    forward_causal=_tflops(292, 423, 521, 579, 602, 616),
    backward=_tflops(316, 424, 501, 542, 559, 561))

# The kernels measured on each GPU (by its roofline's name), as `--attention-kernel`
# names them. "gemm" is no measurement: the kernel priced as one GEMM at the roofline's
# gemm_efficiency, the only choice on a GPU without measured kernels.
MEASURED = {"H100-SXM5-80GB": {"flash2": FLASH2_H100, "cudnn": CUDNN_H100,
                               "flash3": FLASH3_H100}}
GEMM = "gemm"
