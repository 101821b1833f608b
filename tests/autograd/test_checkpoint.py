"""Activation checkpointing: the same gradients, a lower activation peak."""

from __future__ import annotations

import numpy as np

from minipar.autograd import Tensor, checkpoint
from minipar.autograd import functional as F

rng = np.random.default_rng(7)


def make_params():
    return [Tensor(rng.standard_normal(shape), requires_grad=True)
            for shape in [(8, 32), (32,), (32, 8), (8,)]]


def mlp(x, w1, b1, w2, b2):
    return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def run(x_data, params, use_checkpoint, n_layers=3):
    x = Tensor(x_data, requires_grad=True)
    h = x
    for _ in range(n_layers):
        h = checkpoint(mlp, h, *params) if use_checkpoint else mlp(h, *params)
    loss = (h * h).mean()
    loss.backward()
    return loss.item(), x.grad, [p.grad for p in params]


def test_checkpoint_gives_identical_gradients():
    x_data = rng.standard_normal((4, 5, 8))
    params_a = make_params()
    params_b = [Tensor(p.data.copy(), requires_grad=True) for p in params_a]
    loss_a, gx_a, grads_a = run(x_data, params_a, use_checkpoint=False)
    loss_b, gx_b, grads_b = run(x_data, params_b, use_checkpoint=True)
    assert loss_a == loss_b
    np.testing.assert_allclose(gx_b, gx_a, rtol=1e-13)
    for a, b in zip(grads_a, grads_b, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-13)


def test_checkpoint_lowers_the_activation_peak(device):
    x_data = rng.standard_normal((16, 32, 8))
    params = make_params()
    run(x_data, params, use_checkpoint=False)
    plain_peak = device.memory.peak["activations"]
    assert device.memory.current["activations"] == 0
    device.memory.peak.clear()
    for p in params:
        p.release_grad()
    run(x_data, params, use_checkpoint=True)
    assert device.memory.current["activations"] == 0
    assert device.memory.peak["activations"] < 0.6 * plain_peak
    # recomputation costs a second forward
    assert device.flops["forward"] > 0


def test_checkpoint_replays_dropout_masks():
    x_data = rng.standard_normal((2, 3, 8))

    def noisy(x, generator):
        return F.dropout(x * 2.0, 0.5, generator)

    grads = []
    for use in (False, True):
        generator = np.random.default_rng(11)
        x = Tensor(x_data, requires_grad=True)
        out = checkpoint(noisy, x, generator, generator=generator) if use \
            else noisy(x, generator)
        (out * out).sum().backward()
        grads.append(x.grad)
    np.testing.assert_array_equal(grads[0], grads[1])
