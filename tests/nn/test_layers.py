"""Layer conventions: HF GPT-2 weight layouts."""

from __future__ import annotations

import numpy as np

from minipar.autograd import Tensor
from minipar.nn import Dropout, Embedding, LayerNorm, Linear


def test_linear_weight_is_in_by_out_and_used_as_x_at_w():
    layer = Linear(3, 5)
    assert layer.weight.shape == (3, 5) and layer.bias.shape == (5,)
    layer.bias.data[...] = np.arange(5)
    x = np.random.default_rng(0).standard_normal((2, 4, 3))
    np.testing.assert_allclose(layer(Tensor(x)).data, x @ layer.weight.data + np.arange(5))
    assert Linear(3, 5, bias=False).bias is None


def test_layer_norm_normalises_the_last_axis():
    x = np.random.default_rng(1).standard_normal((4, 16)) * 5 + 3
    y = LayerNorm(16)(Tensor(x)).data
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-5)


def test_embedding_lookup():
    table = Embedding(10, 4)
    idx = np.array([[1, 9], [9, 0]])
    np.testing.assert_array_equal(table(idx).data, table.weight.data[idx])


def test_dropout_module_train_and_eval():
    layer = Dropout(0.5, np.random.default_rng(0))
    x = Tensor(np.ones((10, 10)))
    assert np.any(layer(x).data == 0)
    layer.eval()
    assert layer(x) is x


def test_layers_take_a_dtype():
    assert Linear(2, 2, dtype=np.float32).weight.dtype == np.float32
    assert LayerNorm(2, dtype=np.float32).bias.dtype == np.float32


# ------------------------------------------------------------------ shared initial draws
def test_initial_draws_are_drawn_once_read_only_and_within_their_budget():
    from minipar.nn.layers import InitialDraws

    draws, calls = InitialDraws(budget=3 * 8 * 10), []

    def draw(k):
        calls.append(k)
        return np.full(10, 0.5)

    first = draws.get("a", lambda: draw(1))
    assert draws.get("a", lambda: draw(2)) is first and calls == [1]  # kept, not redrawn
    assert not first.flags.writeable  # nobody can change what the next model gets
    for k in "bcd":  # 4 arrays of 80 bytes in a budget of 240: the oldest goes
        draws.get(k, lambda k=k: draw(k))
    draws.get("a", lambda: draw(5))
    assert calls == [1, "b", "c", "d", 5]


def test_layers_own_their_weights_when_the_initial_draw_is_shared():
    from minipar.nn import GPT, GPTConfig

    first, second = Linear(3, 5), Linear(3, 5)
    np.testing.assert_array_equal(first.weight.data, second.weight.data)  # one draw
    first.weight.data[...] = 7.0  # training one layer leaves the next one's start alone
    assert not np.array_equal(Linear(3, 5).weight.data, first.weight.data)
    config = GPTConfig(vocab_size=11, seq_len=8, n_layer=2, n_head=2, d_model=8)
    trained = GPT(config, seed=3)
    start = {name: array.copy() for name, array in trained.state_dict().items()}
    for p in trained.parameters():
        p.data[...] += 1.0
    for name, array in GPT(config, seed=3).state_dict().items():
        np.testing.assert_array_equal(array, start[name])
        np.testing.assert_array_equal(array, GPT.initial_state_dict(config, 3)[name])
