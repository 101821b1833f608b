"""The mixture-of-experts layer on one device: routing by hand, capacity and dropping by
position, the aux loss against its formula, gradients against finite differences, and
an MoE GPT that trains."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minipar.autograd.gradcheck import gradcheck
from minipar.autograd.tensor import Tensor
from minipar.nn.gpt import GPT, GPTConfig, init_parameter, parameter_shapes
from minipar.nn.moe import MoE, capacity, route
from minipar.nn.optim import AdamW


def test_capacity_is_ceil_of_tokens_times_k_over_experts_times_factor():
    assert capacity(10, 4, 2, 1.0) == 5            # 10 x 2 / 4
    assert capacity(10, 4, 1, 1.0) == 3            # ceil(2.5)
    assert capacity(16, 8, 2, 1.25) == 5           # ceil(4 x 1.25)
    assert capacity(7, 3, 1, 0.5) == math.ceil(7 / 3 * 0.5)


def test_routing_picks_top_k_and_drops_later_tokens_over_capacity():
    # 4 tokens, 3 experts, k=1, factor 0.75: capacity ceil(4/3 x 0.75) = 1.
    logits = np.array([[5.0, 0, 0],     # expert 0
                       [0, 5.0, 0],     # expert 1
                       [4.0, 0, 1],     # expert 0 again: over capacity, dropped
                       [0, 0, 3.0]])    # expert 2
    chosen, slot, tokens, cap = route(logits, top_k=1, capacity_factor=0.75)
    assert cap == 1
    np.testing.assert_array_equal(chosen[:, 0], [0, 1, 0, 2])
    np.testing.assert_array_equal(slot[:, 0], [0, 0, -1, 0])   # token 2 is the later one
    np.testing.assert_array_equal(tokens, [2, 1, 1])           # counted before dropping


def test_top_2_gives_distinct_experts_in_logit_order_and_ties_to_the_lower_id():
    logits = np.array([[1.0, 3.0, 2.0], [1.0, 1.0, 1.0]])
    chosen, slot, _, cap = route(logits, top_k=2, capacity_factor=2.0)
    np.testing.assert_array_equal(chosen, [[1, 2], [0, 1]])
    assert (slot >= 0).all() and cap == 3


def _layer(e=4, k=2, c=1.0, coeff=0.1, d=8, seed=0):
    layer = MoE(d, e, k, c, coeff)
    for name, p in layer.named_parameters():
        p.data[...] = init_parameter("h.0.mlp." + name, p.shape,
                                     GPTConfig(d_model=d, n_head=2), seed)
        p.data[...] += np.random.default_rng(1).normal(0, 0.3, p.shape)  # break symmetry
    return layer


def test_output_is_gate_weighted_sum_of_the_kept_experts_and_zero_for_dropped():
    layer = _layer(e=4, k=2, c=0.5)
    x = np.random.default_rng(2).standard_normal((1, 6, 8))
    y = layer(Tensor(x)).data.reshape(6, 8)
    tokens = x.reshape(6, 8)
    logits = tokens @ layer.router.weight.data
    chosen, slot, _, _ = route(logits, 2, 0.5)
    for t in range(6):
        chosen_logits = logits[t, chosen[t]]
        gates = np.exp(chosen_logits - chosen_logits.max())
        gates /= gates.sum()
        expected = np.zeros(8)
        for j in range(2):
            if slot[t, j] >= 0:
                expected += gates[j] * layer.experts.local(int(chosen[t, j]))(
                    Tensor(tokens[t:t + 1])).data[0]
        np.testing.assert_allclose(y[t], expected, rtol=1e-12, atol=1e-14)
    assert layer.last_routing["dropped"] > 0  # the case above covered a drop


def test_aux_loss_is_the_switch_formula():
    e, k, coeff = 4, 2, 0.1
    layer = _layer(e=e, k=k, coeff=coeff)
    x = np.random.default_rng(3).standard_normal((2, 5, 8))
    layer(Tensor(x))
    logits = x.reshape(10, 8) @ layer.router.weight.data
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    fraction_routed = np.bincount(np.argsort(-logits, 1)[:, :k].ravel(), minlength=e) / (10 * k)
    mean_prob = probs.mean(0)
    expected = coeff * e * (fraction_routed * mean_prob).sum()   # Fedus et al. eq. 4
    assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-12)
    # a perfectly balanced router gives coeff (f_e = P_e = 1/E)
    assert coeff * e * (np.full(e, 1 / e) ** 2).sum() == pytest.approx(coeff)


def test_gradients_of_input_router_and_experts_match_finite_differences():
    layer = _layer(e=4, k=2, c=0.75)
    x = np.random.default_rng(4).standard_normal((2, 4, 8))
    router, fc = layer.router, layer.experts.local(1).c_fc

    def fn(x, w_router, w_fc):
        object.__setattr__(router, "weight", w_router)
        object.__setattr__(fc, "weight", w_fc)
        y = layer(x)
        return (y * y).sum() + layer.aux_loss * 10.0

    assert gradcheck(fn, [x, router.weight.data.copy(), fc.weight.data.copy()])
    assert layer.last_routing["dropped"] > 0  # dropping is inside the checked function


def test_moe_gpt_names_every_parameter_and_the_layer_frequency():
    config = GPTConfig(n_layer=3, moe_num_experts=4, moe_layer_freq=2)
    model = GPT(config)
    assert [n for n, _ in model.named_parameters()] == list(parameter_shapes(config))
    names = dict(model.named_parameters())
    assert "h.0.mlp.experts.3.c_fc.weight" in names and "h.2.mlp.router.weight" in names
    assert "h.1.mlp.c_fc.weight" in names  # block 1 stays dense
    dense = GPT(GPTConfig(n_layer=3)).num_parameters()
    expert = 2 * 64 * 4 * 64 + 4 * 64 + 64
    assert model.num_parameters() == dense + 2 * (3 * expert + 64 * 4)


@pytest.mark.parametrize("bad, message", [
    ({"moe_top_k": 5}, "moe_top_k=5 exceeds moe_num_experts=4"),
    ({"moe_capacity_factor": 0.0}, "moe_capacity_factor must be > 0"),
    ({"moe_layer_freq": 0}, "moe_layer_freq must be a positive integer"),
])
def test_bad_settings_are_one_line_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(moe_num_experts=4, **bad)


def test_moe_gpt_trains_loss_falls():
    config = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, moe_num_experts=4,
                       moe_top_k=2, moe_capacity_factor=1.25)
    model = GPT(config, seed=0)
    optimizer = AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 65, (4, 16))
    targets = np.roll(idx, -1, axis=1)
    losses = []
    for _ in range(15):
        model.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert model.h[0].mlp.experts.local(3).c_fc.weight.grad is not None


def test_the_model_returns_the_lm_loss_and_backward_trains_lm_plus_aux():
    # Megatron's MoEAuxLossAutoScaler: the loss is the LM loss alone, yet its backward
    # gives the gradient of LM + sum of aux losses (checked by finite differences).
    config = GPTConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, moe_num_experts=4,
                       moe_aux_loss_coeff=1.0)
    model = GPT(config, seed=0)
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 65, (2, 8))
    targets = np.roll(idx, -1, axis=1)
    logits = model(idx).data
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    lm = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    loss = model(idx, targets)
    assert loss.item() == pytest.approx(lm, rel=1e-12)
    loss.backward()
    router = model.h[0].mlp.router.weight

    def objective(with_aux: bool) -> float:
        value = model(idx, targets).item()
        return value + with_aux * sum(block.mlp.aux_loss.item() for block in model.h)

    for i, j in [(0, 0), (3, 1), (7, 3)]:
        numeric = {}
        for with_aux in (True, False):
            saved = router.data[i, j]
            router.data[i, j] = saved + 1e-6
            up = objective(with_aux)
            router.data[i, j] = saved - 1e-6
            down = objective(with_aux)
            router.data[i, j] = saved
            numeric[with_aux] = (up - down) / 2e-6
        assert router.grad[i, j] == pytest.approx(numeric[True], rel=1e-5, abs=1e-9)
        # ... and not the LM loss's alone: the aux term is there to see
        assert router.grad[i, j] != pytest.approx(numeric[False], rel=1e-2)
