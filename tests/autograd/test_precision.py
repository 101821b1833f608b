"""Precision policies: dtypes and the ZeRO paper's bytes per parameter."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd import bfloat16, get_policy
from minipar.autograd.precision import add


@pytest.mark.parametrize("name, param, grad, optimizer", [
    ("fp64", 8, 8, 16),
    ("fp32", 4, 4, 8),
    ("bf16-mixed", 2, 2, 12),  # ZeRO: 2 + 2 + 12 (fp32 master, m, v)
])
def test_bytes_per_parameter(name, param, grad, optimizer):
    policy = get_policy(name)
    assert policy.param_dtype.itemsize == param
    assert policy.grad_dtype.itemsize == grad
    assert policy.optimizer_bytes_per_param == optimizer


def test_bf16_mixed_dtypes():
    policy = get_policy("bf16-mixed")
    assert policy.param_dtype == bfloat16 and policy.activation_dtype == bfloat16
    assert policy.master_dtype.itemsize == 4


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="fp64.*fp32.*bf16-mixed"):
        get_policy("fp16")


def test_add_of_two_bf16_arrays_is_numpys_bit_for_bit():
    """precision.add takes fp32 loops, not ml_dtypes' bf16 one: the same bits for every
    bf16 pattern (NaNs, infinities, subnormals, signed zeros) against random partners."""
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(bfloat16)
    rng = np.random.default_rng(0)
    with np.errstate(all="ignore"):  # inf - inf, overflow: as NumPy's own add
        for _ in range(3):
            other = rng.integers(0, 2**16, 2**16).astype(np.uint16).view(bfloat16)
            expected = np.add(every, other).view(np.uint16)
            assert np.array_equal(add(every, other).view(np.uint16), expected)
            out = np.empty_like(every)
            assert add(every, other, out=out) is out
            assert np.array_equal(out.view(np.uint16), expected)
        rows, column = every.reshape(256, 256), every[:256].reshape(256, 1)
        wide = every[:2048]  # (both broadcast, to a result large enough for the fp32 path)
        for a, b in ((rows, column), (column, rows), (wide.reshape(-1, 1), wide)):
            assert np.array_equal(add(a, b).view(np.uint16), np.add(a, b).view(np.uint16))
        scalar = add(every[3], every[7])  # a scalar, as np.add returns
        assert type(scalar) is type(np.add(every[3], every[7])) and scalar == every[3] + every[7]
    x = rng.standard_normal(5)
    assert np.array_equal(add(x, x), x + x)  # other dtypes: np.add itself
