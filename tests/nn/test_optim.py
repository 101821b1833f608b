"""AdamW against the paper's formula, its precision handling and state; gradient
clipping; the learning-rate schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minipar.autograd import bfloat16
from minipar.nn import (
    AdamW,
    Parameter,
    adamw_update,
    clip_grad_norm_,
    grad_norm_squared,
    lr_schedule,
)


def reference_adamw(theta, grads, lr, beta1, beta2, eps, wd):
    """Loshchilov & Hutter, Algorithm 2, with the decay scaled by lr (as PyTorch)."""
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        theta = theta - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * theta)
    return theta


def test_adamw_matches_the_reference_formula():
    rng = np.random.default_rng(0)
    theta0 = rng.standard_normal((3, 4))
    grads = [rng.standard_normal((3, 4)) for _ in range(5)]
    p = Parameter(theta0.copy())
    optimizer = AdamW([p], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    for g in grads:
        p.grad = g.copy()
        optimizer.step()
    expected = reference_adamw(theta0, grads, 0.01, 0.8, 0.9, 1e-6, 0.3)
    np.testing.assert_allclose(p.data, expected, rtol=1e-12)


def test_adamw_update_takes_a_per_element_weight_decay():
    theta = np.ones(4)
    adamw_update(theta, np.zeros(4), np.zeros(4), np.zeros(4), step=1, lr=0.1, beta1=0.9,
                 beta2=0.95, eps=1e-8, weight_decay=np.array([0.0, 0.5, 0.0, 1.0]))
    np.testing.assert_allclose(theta, [1.0, 0.95, 1.0, 0.9])


def test_weight_decay_only_on_matrices():
    matrix, bias = Parameter(np.ones((2, 2))), Parameter(np.ones(2))
    optimizer = AdamW([matrix, bias], lr=0.1, weight_decay=0.5)
    matrix.grad, bias.grad = np.zeros((2, 2)), np.zeros(2)
    optimizer.step()
    np.testing.assert_allclose(matrix.data, 0.95)
    np.testing.assert_array_equal(bias.data, 1.0)


def test_bf16_parameters_keep_an_fp32_master_copy():
    p = Parameter(np.ones(4, dtype=bfloat16))
    optimizer = AdamW([p], lr=1e-4, weight_decay=0.0)
    for _ in range(3):
        p.grad = np.ones(4, dtype=bfloat16)
        optimizer.step()
    master = optimizer.master[0]
    assert master.dtype == np.float32 and optimizer.exp_avg[0].dtype == np.float32
    np.testing.assert_allclose(master, 1 - 3e-4, rtol=1e-6)  # fp32 keeps tiny steps
    np.testing.assert_array_equal(p.data, master.astype(bfloat16))
    assert p.data.dtype == bfloat16


@pytest.mark.parametrize("dtype, bytes_per_param", [(np.float64, 16), (np.float32, 8),
                                                     (bfloat16, 12)])
def test_optimizer_state_is_held_in_the_ledger(device, dtype, bytes_per_param):
    params = [Parameter(np.ones((3, 5), dtype=dtype)), Parameter(np.ones(7, dtype=dtype))]
    optimizer = AdamW(params, lr=0.1)
    assert device.memory.current["optimizer"] == bytes_per_param * 22
    for p in params:
        p.grad = np.ones(p.shape, dtype=dtype)
    optimizer.step()
    assert device.flops["optimizer"] > 0


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((2, 3)) for _ in range(4)]

    def fresh():
        p = Parameter(np.ones((2, 3), dtype=bfloat16))
        return p, AdamW([("w", p)], lr=0.01)

    p1, opt1 = fresh()
    for g in grads[:2]:
        p1.grad = g.astype(bfloat16)
        opt1.step()
    state = opt1.state_dict()
    assert set(state) == {"step", "exp_avg.w", "exp_avg_sq.w", "master.w"}
    p2, opt2 = fresh()
    p2.data[...] = p1.data
    opt2.load_state_dict(state)
    for g in grads[2:]:
        for p, opt in ((p1, opt1), (p2, opt2)):
            p.grad = g.astype(bfloat16)
            opt.step()
    np.testing.assert_array_equal(p1.data, p2.data)
    with pytest.raises(KeyError, match="missing keys"):
        opt2.load_state_dict({"step": 1})


def test_clip_grad_norm():
    a, b = Parameter(np.zeros(3)), Parameter(np.zeros((2, 2)))
    a.grad, b.grad = np.array([3.0, 0.0, 0.0]), np.array([[0.0, 4.0], [0.0, 0.0]])
    assert clip_grad_norm_([a, b], max_norm=10.0) == pytest.approx(5.0)
    np.testing.assert_array_equal(a.grad, [3.0, 0.0, 0.0])  # below the limit: unchanged
    assert clip_grad_norm_([a, b], max_norm=1.0) == pytest.approx(5.0)
    assert math.sqrt(grad_norm_squared([a.grad, b.grad])) == pytest.approx(1.0, rel=1e-5)


def test_grad_norm_squared_accumulates_bf16_in_fp64():
    ones = np.ones(100000, dtype=bfloat16)
    assert grad_norm_squared([ones, ones]) == 200000.0


def test_lr_schedule_warmup_then_cosine():
    kwargs = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert lr_schedule(0, **kwargs) == pytest.approx(0.1)
    assert lr_schedule(9, **kwargs) == pytest.approx(1.0)
    assert lr_schedule(10, **kwargs) == pytest.approx(1.0)
    assert lr_schedule(60, **kwargs) == pytest.approx(0.55)  # halfway: cos = 0
    assert lr_schedule(110, **kwargs) == pytest.approx(0.1)
    assert lr_schedule(500, **kwargs) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_schedule(0, lr=1.0, warmup_steps=20, total_steps=10, min_lr=0.0)


def test_invalid_hyperparameters():
    with pytest.raises(ValueError, match="betas"):
        AdamW([Parameter(np.ones(1))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="empty"):
        AdamW([])
