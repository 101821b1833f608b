"""The fused GPT-2 ops: values against independent NumPy formulas, gradients against
finite differences (fp64), fused attention against its pieces, and the bf16 rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minipar.autograd import Tensor, bfloat16, gradcheck, no_grad
from minipar.autograd import functional as F

rng = np.random.default_rng(99)


def randn(*shape):
    return rng.standard_normal(shape)


@pytest.mark.parametrize("x_shape", [(5, 3), (2, 4, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(x_shape, bias):
    x, w, b = randn(*x_shape), randn(3, 4), randn(4)
    expected = x @ w + (b if bias else 0)
    out = F.linear(Tensor(x), Tensor(w), Tensor(b) if bias else None)
    np.testing.assert_allclose(out.data, expected, rtol=1e-13)
    if bias:
        assert gradcheck(lambda x, w, b: F.linear(x, w, b), [x, w, b])
    else:
        assert gradcheck(lambda x, w: F.linear(x, w), [x, w])


def test_linear_transposed_weight_is_x_times_w_transpose():
    x, w = randn(2, 3, 4), randn(5, 4)  # w (out, in) as an embedding table
    out = F.linear(Tensor(x), Tensor(w), None, transpose_weight=True)
    np.testing.assert_allclose(out.data, x @ w.T, rtol=1e-13)
    assert gradcheck(lambda x, w: F.linear(x, w, None, transpose_weight=True), [x, w])


def test_linear_shape_error_names_the_shapes():
    with pytest.raises(ValueError, match="3 features"):
        F.linear(Tensor(randn(2, 3)), Tensor(randn(4, 5)))


@pytest.mark.parametrize("x_shape", [(4, 6), (2, 3, 6)])
def test_layer_norm(x_shape):
    x, w, b = randn(*x_shape) * 3 + 1, randn(6), randn(6)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    expected = (x - mean) / np.sqrt(var + 1e-5) * w + b
    out = F.layer_norm(Tensor(x), Tensor(w), Tensor(b))
    np.testing.assert_allclose(out.data, expected, rtol=1e-12, atol=1e-12)
    assert gradcheck(lambda x, w, b: F.layer_norm(x, w, b), [x, w, b])


def test_gelu_tanh_approximation():
    x = np.linspace(-5, 5, 41).reshape(41, 1)
    expected = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(F.gelu(Tensor(x)).data, expected, rtol=1e-14, atol=1e-15)
    assert gradcheck(F.gelu, [randn(3, 5) * 2])


@pytest.mark.parametrize("causal", [False, True])
def test_softmax(causal):
    x = randn(2, 3, 5, 5)
    p = F.softmax(Tensor(x), causal=causal).data
    masked = np.where(np.triu(np.ones((5, 5)), 1) > 0, -np.inf, x) if causal else x
    expected = np.exp(masked) / np.exp(masked).sum(-1, keepdims=True)
    np.testing.assert_allclose(p, expected, rtol=1e-13, atol=1e-16)
    assert gradcheck(lambda t: F.softmax(t, causal=causal), [x])


def reference_attention(qkv, head_dim):
    """Per batch and head, softmax(causal(q k^T / sqrt(hd))) v, written with loops."""
    batch, length, width = qkv.shape
    n_heads = width // (3 * head_dim)
    out = np.zeros((batch, length, n_heads * head_dim))
    for b in range(batch):
        for h in range(n_heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            q = qkv[b, :, cols]
            k = qkv[b, :, n_heads * head_dim:][:, cols]
            v = qkv[b, :, 2 * n_heads * head_dim:][:, cols]
            for t in range(length):
                scores = q[t] @ k[: t + 1].T / math.sqrt(head_dim)
                weights = np.exp(scores - scores.max())
                out[b, t, cols] = (weights / weights.sum()) @ v[: t + 1]
    return out


@pytest.mark.parametrize("batch, length, n_heads, head_dim", [(2, 3, 2, 2), (1, 5, 3, 4)])
def test_causal_self_attention_matches_reference_and_pieces(batch, length, n_heads, head_dim):
    qkv = randn(batch, length, 3 * n_heads * head_dim)
    fused = F.causal_self_attention(Tensor(qkv), head_dim).data
    np.testing.assert_allclose(fused, reference_attention(qkv, head_dim), rtol=1e-12,
                               atol=1e-14)

    def from_pieces(t):
        q, k, v = t.split(n_heads * head_dim, axis=-1)
        heads = [x.reshape(batch, length, n_heads, head_dim).transpose(1, 2) for x in (q, k, v)]
        att = F.softmax(heads[0] @ heads[1].transpose(2, 3) / math.sqrt(head_dim), causal=True)
        return (att @ heads[2]).transpose(1, 2).reshape(batch, length, n_heads * head_dim)

    np.testing.assert_allclose(from_pieces(Tensor(qkv)).data, fused, rtol=1e-12, atol=1e-14)
    assert gradcheck(lambda t: F.causal_self_attention(t, head_dim), [qkv])
    assert gradcheck(from_pieces, [qkv])


def test_attention_dropout_is_seeded_and_differentiable():
    qkv = randn(2, 4, 12)

    def fn(t):
        return F.causal_self_attention(t, 2, 0.3, np.random.default_rng(5))

    np.testing.assert_array_equal(fn(Tensor(qkv)).data, fn(Tensor(qkv)).data)
    assert not np.allclose(fn(Tensor(qkv)).data, F.causal_self_attention(Tensor(qkv), 2).data)
    assert gradcheck(fn, [qkv])


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 7)])
def test_cross_entropy(shape):
    logits = randn(*shape)
    targets = rng.integers(0, shape[-1], size=shape[:-1])
    flat = logits.reshape(-1, shape[-1])
    log_probs = flat - np.log(np.exp(flat).sum(-1, keepdims=True))
    expected = -log_probs[np.arange(len(flat)), targets.reshape(-1)].mean()
    np.testing.assert_allclose(F.cross_entropy(Tensor(logits), targets).item(), expected,
                               rtol=1e-14)
    assert gradcheck(lambda z: F.cross_entropy(z, targets), [logits])


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1000.0, 0.0, -1000.0]])
    loss = F.cross_entropy(Tensor(logits, requires_grad=True), np.array([1]))
    assert loss.item() == pytest.approx(1000.0)


def test_cross_entropy_rejects_bad_targets():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        F.cross_entropy(Tensor(randn(2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="shape"):
        F.cross_entropy(Tensor(randn(2, 3)), np.array([0, 1, 2]))


def test_embedding_scatter_adds_repeated_tokens():
    weight = randn(5, 3)
    idx = np.array([[0, 2, 2], [4, 2, 0]])
    np.testing.assert_array_equal(F.embedding(idx, Tensor(weight)).data, weight[idx])
    assert gradcheck(lambda w: F.embedding(idx, w), [weight])
    w = Tensor(weight, requires_grad=True)
    F.embedding(idx, w).sum().backward()
    np.testing.assert_array_equal(w.grad[:, 0], [2, 0, 3, 0, 1])  # token counts
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        F.embedding(np.array([5]), w)


def test_dropout():
    x = randn(200, 50)
    assert F.dropout(Tensor(x), 0.0, None).data is x  # p = 0: identity, no node
    assert F.dropout(Tensor(x), 0.5, None, training=False).data is x
    out = F.dropout(Tensor(x), 0.25, np.random.default_rng(0)).data
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(out[kept], x[kept] / 0.75)
    assert gradcheck(lambda t: F.dropout(t, 0.25, np.random.default_rng(3)), [randn(4, 5)])
    with pytest.raises(ValueError, match="probability"):
        F.dropout(Tensor(x), 1.0, np.random.default_rng(0))


# ----------------------------------------------------------------------------- bf16
def test_bf16_matmul_accumulates_in_fp32_and_returns_bf16():
    a = np.full((1, 4096), 1.0).astype(bfloat16)
    b = np.full((4096, 1), 1.0).astype(bfloat16)
    out = (Tensor(a) @ Tensor(b)).data
    assert out.dtype == bfloat16
    assert float(out[0, 0]) == 4096.0  # a bf16 accumulator would stall at 256


def test_bf16_sum_accumulates_in_fp32():
    s = Tensor(np.ones(10000, dtype=bfloat16)).sum()
    assert s.dtype == bfloat16 and float(s.data) == pytest.approx(10000, rel=1e-2)


def test_bf16_scalar_ops_keep_bf16():
    x = Tensor(np.ones(3, dtype=bfloat16))
    assert (x * 0.5).dtype == bfloat16 and (1.0 - x).dtype == bfloat16


def test_fused_ops_in_bf16_stay_close_to_fp64():
    qkv64, x64 = randn(2, 6, 24), randn(2, 6, 8)
    w64, b64 = randn(8), randn(8)
    targets = rng.integers(0, 8, size=(2, 6))
    cases = [
        lambda q, x, w, b: F.causal_self_attention(q, 4),
        lambda q, x, w, b: F.layer_norm(x, w, b),
        lambda q, x, w, b: F.gelu(x),
        lambda q, x, w, b: F.cross_entropy(x, targets),
        lambda q, x, w, b: F.linear(x, q[0, :, :8].T),
    ]
    for fn in cases:
        ref = fn(*(Tensor(a) for a in (qkv64, x64, w64, b64))).data
        inputs = [Tensor(a.astype(bfloat16), requires_grad=True)
                  for a in (qkv64, x64, w64, b64)]
        out = fn(*inputs)
        out.backward(np.ones(out.shape, dtype=out.dtype))
        assert out.dtype in (bfloat16, np.float32)
        np.testing.assert_allclose(out.data.astype(np.float64), ref, rtol=0.05, atol=0.05)
        assert all(t.grad is None or t.grad.dtype == bfloat16 for t in inputs)


def test_no_grad_records_nothing():
    x = Tensor(randn(2, 3), requires_grad=True)
    with no_grad():
        y = F.gelu(x) * 2.0
    assert not y.requires_grad and y._ctx is None


@pytest.mark.parametrize("n_heads, kv_heads", [(4, 2), (4, 1), (6, 3)])
def test_grouped_query_attention_is_attention_with_shared_key_value_heads(n_heads, kv_heads):
    batch, length, head_dim = 2, 5, 3
    group = n_heads // kv_heads
    qkv = randn(batch, length, kv_heads * (group + 2) * head_dim)  # Megatron's layout
    heads = qkv.reshape(batch, length, kv_heads, group + 2, head_dim)
    q = heads[:, :, :, :group].reshape(batch, length, n_heads * head_dim)
    # query head h reads key/value head h // group: repeat them and run MHA
    k, v = (np.repeat(heads[:, :, :, i], group, axis=2).reshape(batch, length, -1)
            for i in (group, group + 1))
    expected = reference_attention(np.concatenate([q, k, v], axis=-1), head_dim)
    out = F.grouped_query_attention(Tensor(qkv), head_dim, group).data
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)
    assert gradcheck(lambda t: F.grouped_query_attention(t, head_dim, group), [qkv])
    dropped = lambda t: F.grouped_query_attention(t, head_dim, group, 0.3,  # noqa: E731
                                                  np.random.default_rng(5))
    assert gradcheck(dropped, [qkv])


def test_swiglu_matches_its_formula_and_finite_differences():
    x = randn(2, 3, 8)
    a, b = x[..., :4], x[..., 4:]
    expected = a / (1 + np.exp(-a)) * b
    np.testing.assert_allclose(F.swiglu(Tensor(x)).data, expected, rtol=1e-14)
    assert gradcheck(F.swiglu, [x])
    out = F.swiglu(Tensor(x.astype(bfloat16), requires_grad=True))
    assert out.dtype == bfloat16 and out.shape == (2, 3, 4)
