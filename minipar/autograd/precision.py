"""Number formats: precision policies and the bf16 rules every op follows.

A policy names the dtype of each kind of array a training step holds. The byte counts
are the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3.1): mixed precision
keeps 2 bytes of bf16 parameters and 2 of bf16 gradients per parameter, plus 12 bytes of
optimizer state (fp32 master weights, fp32 Adam first and second moments) - "2+2+12".

bf16 arrays use `ml_dtypes.bfloat16`. NumPy has no bf16 arithmetic of its own, so ops
follow what a GPU does (see TOOLING.md): matmuls take bf16 in, accumulate in fp32 and
round the result to bf16 (a tensor core); reductions and fused kernels (softmax,
LayerNorm, cross-entropy) compute in fp32 and store bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one precision setting.

    `master_dtype` is the dtype of the optimizer's copy of the weights that it updates;
    it is None when the parameters themselves are updated in place (fp32, fp64).
    """

    name: str
    param_dtype: np.dtype
    grad_dtype: np.dtype
    activation_dtype: np.dtype
    optimizer_dtype: np.dtype  # Adam moments m and v
    master_dtype: np.dtype | None

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Bytes of optimizer state per parameter: master copy (if any) + m + v."""
        master = 0 if self.master_dtype is None else self.master_dtype.itemsize
        return master + 2 * self.optimizer_dtype.itemsize


POLICIES = {
    "fp64": PrecisionPolicy("fp64", float64, float64, float64, float64, None),
    "fp32": PrecisionPolicy("fp32", float32, float32, float32, float32, None),
    "bf16-mixed": PrecisionPolicy("bf16-mixed", bfloat16, bfloat16, bfloat16, float32, float32),
}


def get_policy(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The policy called `name` ("fp64", "fp32" or "bf16-mixed")."""
    if isinstance(name, PrecisionPolicy):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(n) for n in POLICIES)
        raise ValueError(f"unknown precision {name!r}; choose one of {valid}") from None


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype an op computes in for inputs of `dtype`: fp32 for bf16, else itself."""
    return float32 if dtype == bfloat16 else dtype


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`a @ b`, with bf16 handled like a tensor core: fp32 accumulate, bf16 result.

    Never `np.dot`/`einsum` on bf16 arrays: NumPy falls back to a generic loop ~300x
    slower, and `a @ b` on bf16 silently returns fp32.
    """
    if a.dtype == bfloat16:
        return (a.astype(float32) @ b.astype(float32)).astype(bfloat16)
    return a @ b


def add(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`np.add(a, b, out=out)`, bit for bit, and for two large bf16 arrays ~2x faster.

    NumPy adds two bf16 arrays with ml_dtypes' loop, which converts element by element:
    ~25x the time of an fp32 add of the same shape. It computes each sum in fp32 and
    rounds it to bf16 (round to nearest even), which is what the fp32 add followed by a
    cast does with NumPy's fast loops (every one of the 65,536 bf16 patterns checked in
    tests/autograd/test_precision.py). Gradients summed in backward, the residual adds
    and the collectives' reductions are bf16 adds in bf16-mixed runs."""
    if (getattr(a, "dtype", None) != bfloat16 or getattr(b, "dtype", None) != bfloat16
            or max(a.size, b.size) < 2048):  # (below, ml_dtypes' loop is quicker)
        return np.add(a, b, out=out)
    if a.shape != b.shape:  # the fp32 copy takes the result's shape (a broadcast bias)
        shape = np.broadcast_shapes(a.shape, b.shape)
        if a.shape != shape:
            a, b = b, a  # (an fp32 add commutes, bit for bit)
        if a.shape != shape:  # (neither has it: both broadcast)
            a = np.broadcast_to(a, shape)
    total = np.array(a, dtype=float32)  # (an array also when a is a scalar)
    np.add(total, b, out=total)  # b converted to fp32 as it is read
    if out is None:
        total = total.astype(bfloat16)
        return total if total.ndim else total[()]  # a scalar, as np.add returns
    out[...] = total
    return out


def sum_to_dtype(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """`x.sum(...)` accumulated in fp32 when x is bf16 (a bf16 sum stalls at 256)."""
    if x.dtype == bfloat16:
        return x.sum(axis=axis, keepdims=keepdims, dtype=float32).astype(bfloat16)
    return x.sum(axis=axis, keepdims=keepdims)
