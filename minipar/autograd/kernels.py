"""The kernels an op runs, as a GPU cost model needs them: FLOPs, bytes moved, GEMM shape.

FLOPs alone price every op at one rate. A real GPU runs a matrix multiply on its tensor
cores at a rate that depends on the product's shape, and an elementwise op at the speed
its bytes stream through HBM (minipar.distributed.roofline prices both). So an op may
describe its work as `Kernel`s:

    Kernel(flops, nbytes)                       elementwise / reduction: bytes read + written
    gemm_kernel(batch, m, n, k, itemsize)       batch products (m, k) @ (k, n)

Ops that set nothing get one kernel: their FLOPs, and the bytes of their inputs and outputs
(forward) or of the incoming gradients, the saved arrays and the gradients they return
(backward), i.e. an unfused kernel that reads its operands once and writes its results once.

The builders an op calls on every forward (`linear_kernels`, `attention_kernels`) are
pure functions of a few integers and return frozen Kernels in tuples, so they are cached:
a layer asks for the same shapes every micro-batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FusedAttention:
    """What one fused attention kernel (FlashAttention: Dao et al. 2022; cuDNN's flash
    attention) runs, in the count its published benchmarks divide by time
    (flash-attention's benchmarks/benchmark_flash_attention.py `flops`): 4 s_q s_k d per
    (sequence, head) pair forward, half of it with a causal mask, and 2.5 times that
    backward (the backward recomputes q k^T and runs four products of gradients).

    backward: the backward kernel. causal: masked above the diagonal. seq_len: the
    keys each query attends over and head_dim: d (what the measured rate depends on).
    flops: that count.
    """

    backward: bool
    causal: bool
    seq_len: int
    head_dim: int
    flops: float


@dataclass(frozen=True)
class Kernel:
    """One kernel: its FLOPs, the bytes it reads and writes in HBM, and, for a matrix
    multiply, its shape (batch, m, n, k): batch products of (m, k) @ (k, n). attention:
    a fused attention kernel's work as its benchmarks count it, for a cost model that
    prices such kernels at their own measured rate (minipar.distributed.roofline). fp8:
    the GEMM's operands are 8-bit floats, run on the FP8 tensor cores (Transformer
    Engine's FP8 linear layers, which the planner prices: minipar/plan/fp8.py; minipar's
    own ops never set it)."""

    flops: float
    nbytes: float
    gemm: tuple[int, int, int, int] | None = None
    attention: FusedAttention | None = None
    fp8: bool = False


def gemm_kernel(batch: int, m: int, n: int, k: int, itemsize: int,
                epilogue_flops: float = 0.0) -> Kernel:
    """The GEMM C (m, n) = A (m, k) @ B (k, n), `batch` times: 2mnk FLOPs each; reads A
    and B and writes C once. epilogue_flops: elementwise work fused into the GEMM's
    epilogue (a bias add), counted but not priced apart (cuBLAS's epilogues)."""
    return Kernel(flops=2.0 * batch * m * n * k + epilogue_flops,
                  nbytes=float(itemsize * batch * (m * k + k * n + m * n)),
                  gemm=(batch, m, n, k))


def linear_backward_kernels(batch: int, m: int, n: int, k: int, itemsize: int,
                            bias: bool = False) -> tuple[Kernel, Kernel]:
    """The two GEMMs of backward for forward (m, k) @ (k, n): the input gradient
    dA (m, k) = dC (m, n) @ B^T (n, k) and the weight gradient dB (k, n) = A^T (k, m) @
    dC (m, n) (with a bias, its gradient, the column sums of dC, in the latter's epilogue).
    """
    return (gemm_kernel(batch, m, k, n, itemsize),
            gemm_kernel(batch, k, n, m, itemsize, epilogue_flops=batch * m * n if bias else 0))


@functools.lru_cache(maxsize=1024)
def linear_kernels(m: int, n: int, k: int, itemsize: int, bias: bool
                   ) -> tuple[tuple[Kernel], tuple[Kernel, Kernel]]:
    """(forward, backward) kernels of a linear layer (m, k) @ (k, n) (+ bias, in the
    GEMM's epilogue)."""
    return ((gemm_kernel(1, m, n, k, itemsize, epilogue_flops=m * n if bias else 0),),
            linear_backward_kernels(1, m, n, k, itemsize, bias=bias))


@functools.lru_cache(maxsize=1024)
def attention_kernels(heads: int, s: int, d: int, itemsize: int, dropout: bool
                      ) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """(forward, backward) kernels of causal attention over `heads` (sequence, head) pairs
    of s tokens and head_dim d, as Megatron-LM runs it without flash attention: the
    scores GEMM q k^T, one fused scale-mask-softmax (reads the scores, writes the
    probabilities: Megatron's fused_softmax), dropout (reads, writes, and a one-byte mask),
    the GEMM p v; backward the four GEMMs of the two products' gradients and the softmax
    and dropout backward (each reads two (s, s) arrays and writes one). FLOPs: the two
    products 4 heads s^2 d, the softmax 5 per score forward and 4 backward (dropout's are
    counted in those, minipar's convention)."""
    e, scores = itemsize, heads * s * s
    forward = [gemm_kernel(heads, s, s, d, e), Kernel(5 * scores, 2 * e * scores)]
    backward = list(linear_backward_kernels(heads, s, d, s, e))
    if dropout:
        forward.append(Kernel(0, (2 * e + 1) * scores))
        backward.append(Kernel(0, (2 * e + 1) * scores))
    forward.append(gemm_kernel(heads, s, d, s, e))
    backward += [Kernel(4 * scores, 3 * e * scores), *linear_backward_kernels(heads, s, s, d, e)]
    return tuple(forward), tuple(backward)


def array_bytes(items) -> int:
    """Bytes of the ndarrays among `items` (other values count nothing)."""
    return sum(item.nbytes for item in items if isinstance(item, np.ndarray))


FLASH_BLOCK = 128  # FlashAttention-2's key/value block (its A100/H100 kernels: 64-128)


def flash_causal_share(s: int) -> float:
    """The share of the s x s query-key products a causal FlashAttention kernel runs: it
    skips the key blocks above the diagonal (Dao 2023, FlashAttention-2, section 3.1.1),
    (s + FLASH_BLOCK) / 2s of them (all of them for s up to one block)."""
    return min(1.0, (s + FLASH_BLOCK) / (2 * s))


def ring_attention_block_kernels(heads: int, c: int, d: int, itemsize: int,
                                 flash: bool = False
                                 ) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """(forward, backward) kernels of one chunk pair of ring attention (c query tokens
    against c key tokens, `heads` (sequence, head) pairs, head_dim d), FlashAttention's
    way (minipar/parallel/context/ring_attention.py): forward the scores GEMM, the online-softmax
    update (reads the scores, 5 FLOPs each as `attention_kernels`' softmax) and the GEMM
    p v; backward recomputes the scores and p (1 FLOP each more), the GEMMs dV = p^T dO
    and dP = dO V^T, the softmax backward (4 per score; reads p and dP, writes dS) and
    the GEMMs dQ = dS K, dK = dS^T Q. flash: the same FLOPs as one fused kernel each
    way that reads q, k, v (and dO) and writes o (dq, dk, dv), as Transformer Engine
    runs each block with FlashAttention (the planner's `flash_attention` clusters)."""
    e, scores = itemsize, heads * c * c
    if flash:  # a full c x c block (the diagonal's mask is a share of the busiest pairs)
        forward_flops = 4 * scores * d + 5 * scores
        backward_flops = 10 * scores * d + 9 * scores
        q_k_v_o = 4 * e * heads * c * d
        products = 4 * scores * d
        return ((Kernel(forward_flops, q_k_v_o, gemm=(heads, c, d, c),
                        attention=FusedAttention(False, False, c, d, products)),),
                (Kernel(backward_flops, 2 * q_k_v_o, gemm=(heads, c, d, c),
                        attention=FusedAttention(True, False, c, d, 2.5 * products)),))
    forward = (gemm_kernel(heads, c, c, d, e), Kernel(5 * scores, 2 * e * scores),
               gemm_kernel(heads, c, d, c, e))
    backward = (gemm_kernel(heads, c, c, d, e), Kernel(5 * scores, 2 * e * scores),
                gemm_kernel(heads, c, d, c, e), gemm_kernel(heads, c, c, d, e),
                Kernel(4 * scores, 3 * e * scores),
                gemm_kernel(heads, c, d, c, e), gemm_kernel(heads, c, d, c, e))
    return forward, backward
