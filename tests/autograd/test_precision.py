"""Precision policies: dtypes and the ZeRO paper's bytes per parameter."""

from __future__ import annotations

import pytest

from minipar.autograd import bfloat16, get_policy


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
