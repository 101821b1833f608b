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
