"""Block-wise symmetric quantization, as ZeRO++ sends weights (int8) and gradients (int4)
(Wang et al. 2023, "ZeRO++", section 4.1: "block-based quantization", each block of
consecutive elements with its own scale, so one large value spoils only its block).

DeepSpeed's kernel (csrc/includes/quantization_utils.h, `Params<Type::Symmetric,
numBits>`), for a block whose largest |x| is m and b bits:

    step = 2m / 2^b                          (the stored fp32 scale; 1 for an all-zero block)
    q    = clamp(round(x / step), -2^(b-1), 2^(b-1) - 1)
    x'   = q * step                          |x' - x| <= step / 2 = m / 2^b

so int8 keeps each weight within m/256 of its value, int4 each gradient within m/16.
int4 values travel two to a byte (the low nibble first), and every block adds its 4-byte
scale to what is sent: the bytes the ledger books are the packed values plus the scales.

    q, scales = quantize(x, bits=8, block=2048)    # x: (n,) -> q: (n,) int8, scales: (blocks,)
    x2 = dequantize(q, scales, bits=8, block=2048, n=n, dtype=x.dtype)

Where minipar differs: the rounding runs in fp64 (the kernel multiplies in fp32), and
the blocks are runs of a flat shard (DeepSpeed cuts weights into groups of about 4-8k
elements, `CUDAQuantizer.target_group_size`, and gradients per tensor, max(rows, cols,
world) groups).
"""

from __future__ import annotations

import numpy as np

from minipar.autograd.precision import float32

# Elements per block: ZeRO++'s weights in groups of a few thousand (DeepSpeed targets
# 4-8k), gradients in groups of about a row of a weight matrix (max(rows, cols) groups
# per tensor: a row of the demo model's 192-wide matrices).
WEIGHT_BLOCK = 2048
GRADIENT_BLOCK = 256


def quantize(x: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(q, scales): x (n,) cut into blocks of `block` elements (the last may be shorter),
    each quantized to `bits` (8 or 4) with its own fp32 scale. q: (n,) int8 for 8 bits,
    (ceil(n / 2),) uint8 of packed nibbles for 4; scales: (ceil(n / block),) fp32."""
    n = x.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block)
    padded[:n] = x
    padded = padded.reshape(blocks, block)
    largest = np.abs(padded).max(axis=1)
    step = (2 * largest / 2**bits).astype(float32)
    step[largest == 0] = 1.0
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = np.clip(np.rint(padded / step[:, None].astype(np.float64)), low, high)
    q = q.reshape(-1)[:n].astype(np.int8)
    return (pack_int4(q) if bits == 4 else q), step


def dequantize(q: np.ndarray, scales: np.ndarray, bits: int, block: int, n: int,
               dtype) -> np.ndarray:
    """x' (n,) of `dtype` from what `quantize` made of n elements."""
    values = unpack_int4(q, n) if bits == 4 else q
    steps = np.repeat(scales.astype(np.float64), block)[:n]
    return (values.astype(np.float64) * steps).astype(dtype)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """(ceil(n / 2),) uint8: q[2i] in the low nibble of byte i, q[2i + 1] in the high one
    (two's complement; an odd n pads a zero nibble)."""
    nibbles = np.zeros(q.size + q.size % 2, np.uint8)
    nibbles[:q.size] = q.astype(np.uint8) & 0x0F
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """(n,) int8 from `pack_int4`'s bytes."""
    nibbles = np.empty(2 * packed.size, np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
    values = nibbles[:n].astype(np.int8)
    return np.where(values > 7, values - 16, values).astype(np.int8)


def quantized_nbytes(n: int, bits: int, block: int) -> int:
    """Bytes `quantize` makes of n elements: the values and the fp32 scales."""
    return -(-n * bits // 8) + 4 * -(-n // block)
