"""Fused neural-network ops: what GPT-2 is made of, one `Function` each.

Fusing an op (LayerNorm, softmax attention, cross-entropy) into one node saves Python
overhead, temporaries and saved activations, as fused GPU kernels do. The elementary
pieces in ops.py compose to the same results and the tests check that they agree.

bf16 inputs are computed in fp32 and the results rounded to bf16 (fused kernels keep
their internals in fp32); the loss itself is fp32.

FLOP counts (reported to the device): matmuls 2*M*K*N forward and 4*M*K*N backward;
elementwise work a few FLOPs per element, as noted on each op.

This module is long because it holds every fused op GPT-2 needs (Linear, LayerNorm,
GELU, softmax, attention, cross-entropy and its pieces, embedding, dropout), one
`Function` of forward and backward each, in one place as `torch.nn.functional` does;
each op is one section and reads on its own.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from minipar.autograd.function import Function
from minipar.autograd.kernels import attention_kernels, linear_kernels
from minipar.autograd.placement import require_reduced
from minipar.autograd.precision import bfloat16, compute_dtype, float32
from minipar.autograd.tensor import Tensor
from minipar.autograd.tracking import long_call


def row_sum(x: np.ndarray) -> np.ndarray:
    """Sums over the last axis, keeping it (size 1). `einsum` is ~3x faster here than
    `x.sum(-1)`, whose reduction pays a fixed cost per short row (rows of T or d)."""
    return np.einsum("...j->...", x)[..., None]


def row_dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """sum(x * y) over the last axis, keeping it, without materialising x * y."""
    return np.einsum("...j,...j->...", x, y)[..., None]


# ---------------------------------------------------------------------------- Linear
def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """2-D a @ b as a tensor core does it: bf16 in, fp32 accumulate, fp32 out for bf16
    (the caller rounds). One long NumPy call, so it lends the device's turn meanwhile."""
    if a.dtype == bfloat16:
        a, b = a.astype(float32), b.astype(float32)
    with long_call(2 * a.shape[0] * a.shape[1] * b.shape[1]):
        return a @ b


class Linear(Function):
    """y = x @ W + b with x (..., in), W (in, out) as in HF GPT-2's Conv1D.

    With `transpose_weight`, W is stored (out, in) and y = x @ W.T (the LM head tied to
    the token embedding (vocab, d_model)).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, transpose_weight):
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)
        w = weight.T if transpose_weight else weight
        if w.shape[0] != in_features:
            raise ValueError(
                f"linear: input has {in_features} features but the weight is {weight.shape}"
                f"{' (transposed)' if transpose_weight else ''}"
            )
        m, n = x2.shape[0], w.shape[1]
        y = matmul(x2, w)
        if x.dtype == bfloat16:  # the bias added in fp32, then rounded (the GEMM's epilogue)
            if bias is not None:
                y += bias.astype(float32)
            y = y.astype(bfloat16)
        elif bias is not None:
            y += bias
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.x_shape = x.shape
        ctx.transpose_weight = transpose_weight
        ctx.flops_forward = 2 * m * in_features * n + (m * n if bias is not None else 0)
        ctx.flops_backward = 4 * m * in_features * n + (m * n if bias is not None else 0)
        ctx.kernels_forward, ctx.kernels_backward = linear_kernels(
            m, n, in_features, x.dtype.itemsize, bias is not None)
        # per argument, the kernels of its gradient (the split backward's B takes dx,
        # W the weight GEMM with the bias in its epilogue: engine.backward_input)
        ctx.backward_by_input = ((ctx.kernels_backward[0],), (ctx.kernels_backward[1],),
                                 (), ())
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad.reshape(-1, grad.shape[-1])
        bf16 = grad.dtype == bfloat16
        if bf16:
            g2 = g2.astype(float32)
        grad_x = grad_w = grad_b = None
        if need_x:
            w = weight.astype(float32) if bf16 else weight
            w = w if ctx.transpose_weight else w.T
        if need_w:
            x = x.reshape(-1, x.shape[-1])
            if bf16:
                x = x.astype(float32)
        with long_call(2 * g2.size * ctx.x_shape[-1] * (need_x + need_w)):
            if need_x:
                grad_x = (g2 @ w).reshape(ctx.x_shape)
            if need_w:
                grad_w = g2.T @ x if ctx.transpose_weight else x.T @ g2
        if need_b:
            grad_b = g2.sum(axis=0)
        if bf16:
            grad_x, grad_w, grad_b = (None if g is None else g.astype(bfloat16)
                                      for g in (grad_x, grad_w, grad_b))
        return grad_x, grad_w, grad_b, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           transpose_weight: bool = False) -> Tensor:
    """x @ W + b (W stored (in, out)); see `Linear`."""
    require_reduced(x, "linear")
    return Linear.apply(x, weight, bias, transpose_weight)


# ---------------------------------------------------------------------------- LayerNorm
class LayerNorm(Function):
    """LayerNorm over the last axis (Ba, Kiros & Hinton 2016), GPT-2's eps 1e-5.

    Saves the normalised input xhat and 1/std, the two things backward needs:
    dx = (1/std) * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        d = x.shape[-1]
        work = compute_dtype(x.dtype)
        x2 = x.reshape(-1, d).astype(work, copy=False)
        xhat = x2 - row_sum(x2) / d
        variance = row_dot(xhat, xhat) / d
        rstd = 1.0 / np.sqrt(variance + eps)  # (N, 1)
        xhat *= rstd
        y = xhat * weight.astype(work, copy=False)
        y += bias.astype(work, copy=False)
        ctx.save_for_backward(xhat.astype(x.dtype, copy=False), rstd, weight)
        ctx.x_shape = x.shape
        ctx.flops_forward = 8 * x.size
        ctx.flops_backward = 12 * x.size
        return y.astype(x.dtype, copy=False).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        work = compute_dtype(grad.dtype)
        d = xhat.shape[-1]
        g2 = grad.reshape(-1, d).astype(work, copy=False)
        xhat = xhat.astype(work, copy=False)
        grad_w = np.einsum("ij,ij->j", g2, xhat)
        grad_b = g2.sum(axis=0)
        dxhat = g2 * weight.astype(work, copy=False)
        grad_x = dxhat - row_sum(dxhat) / d
        grad_x -= xhat * (row_dot(dxhat, xhat) / d)
        grad_x *= rstd
        dtype = grad.dtype
        return (grad_x.astype(dtype, copy=False).reshape(ctx.x_shape),
                grad_w.astype(dtype, copy=False), grad_b.astype(dtype, copy=False), None)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    require_reduced(x, "layer_norm")
    return LayerNorm.apply(x, weight, bias, eps)


# ---------------------------------------------------------------------------- GELU
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


class GELU(Function):
    """GELU, tanh approximation (Hendrycks & Gimpel 2016), as GPT-2 uses it:
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Saves only x, like PyTorch."""

    @staticmethod
    def forward(ctx, x):
        work = compute_dtype(x.dtype)
        xw = x.astype(work, copy=False)
        t = xw * xw
        t *= _GELU_C * _GELU_K
        t += _GELU_C
        t *= xw
        np.tanh(t, out=t)  # t = tanh(c (x + k x^3))
        t += 1.0
        t *= xw
        t *= 0.5
        ctx.save_for_backward(x)
        ctx.flops_forward = 8 * x.size
        ctx.flops_backward = 14 * x.size
        return t.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        work = compute_dtype(x.dtype)
        xw = x.astype(work, copy=False)
        x_squared = xw * xw
        t = x_squared * (_GELU_C * _GELU_K)
        t += _GELU_C
        t *= xw
        np.tanh(t, out=t)
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 k x^2)
        x_squared *= 3 * _GELU_C * _GELU_K
        x_squared += _GELU_C
        x_squared *= xw
        sech_squared = t * t
        np.subtract(1.0, sech_squared, out=sech_squared)
        x_squared *= sech_squared
        t += 1.0
        t += x_squared
        t *= 0.5
        t *= grad
        return t.astype(x.dtype, copy=False)


def gelu(x: Tensor) -> Tensor:
    require_reduced(x, "gelu")
    return GELU.apply(x)


class SwiGLU(Function):
    """The gated linear unit of Llama's MLP (Shazeer 2020, "GLU Variants Improve
    Transformer"): x = [a | b] of width 2f -> silu(a) * b of width f, silu(a) =
    a sigmoid(a). Megatron-LM's `bias_swiglu` on linear_fc1's fused output, as here.
    Saves only x; 5 FLOPs per output element forward, 8 backward (minipar's convention,
    as plan/shapes.py counts it)."""

    @staticmethod
    def forward(ctx, x):
        work = compute_dtype(x.dtype)
        a, b = np.split(x.astype(work, copy=False), 2, axis=-1)
        y = 1.0 / (1.0 + np.exp(-a))  # sigmoid(a)
        y *= a
        y *= b
        ctx.save_for_backward(x)
        ctx.flops_forward = 5 * y.size
        ctx.flops_backward = 8 * y.size
        return y.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        work = compute_dtype(x.dtype)
        a, b = np.split(x.astype(work, copy=False), 2, axis=-1)
        g = grad.astype(work, copy=False)
        sig = 1.0 / (1.0 + np.exp(-a))
        silu = a * sig
        # d silu / da = sig (1 + a (1 - sig))
        da = 1.0 - sig
        da *= a
        da += 1.0
        da *= sig
        da *= b
        da *= g
        db = silu * g
        return np.concatenate([da, db], axis=-1).astype(x.dtype, copy=False)


def swiglu(x: Tensor) -> Tensor:
    require_reduced(x, "swiglu")
    return SwiGLU.apply(x)


# ---------------------------------------------------------------------------- softmax
@functools.lru_cache(maxsize=64)
def causal_mask(length: int, dtype_name: str) -> np.ndarray:
    """(length, length) additive mask: 0 on and below the diagonal, -inf above it,
    so position t attends to positions <= t (read-only, cached)."""
    mask = np.triu(np.full((length, length), -np.inf, dtype=np.dtype(dtype_name)), k=1)
    mask.flags.writeable = False
    return mask


def _softmax_inplace(scores: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis, overwriting `scores`."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= row_sum(scores)
    return scores


class Softmax(Function):
    """Softmax over the last axis; with `causal`, the last two axes (T, T) are masked
    so that row t only sees columns <= t."""

    @staticmethod
    def forward(ctx, x, causal):
        probs = x.astype(compute_dtype(x.dtype), copy=True)
        if causal:
            probs += causal_mask(x.shape[-1], probs.dtype.name)
        _softmax_inplace(probs)
        probs = probs.astype(x.dtype, copy=False)
        ctx.save_for_backward(probs)
        ctx.flops_forward = 5 * x.size
        ctx.flops_backward = 4 * x.size
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        work = compute_dtype(grad.dtype)
        p = probs.astype(work, copy=False)
        g = grad.astype(work, copy=False) * p
        g -= p * row_sum(g)  # p * (grad - sum(grad * p))
        return g.astype(grad.dtype, copy=False), None


def softmax(x: Tensor, causal: bool = False) -> Tensor:
    require_reduced(x, "softmax")
    return Softmax.apply(x, causal)


# ---------------------------------------------------------------------------- attention
def _attention_forward(q, k, v, dropout_p, generator):
    """softmax(causal(q k^T / sqrt(hd))) v on (B, H, T, hd) arrays of the compute dtype:
    (the output (B, H, T, hd), the probabilities, the dropout's keep mask or None)."""
    length, head_dim = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    att = (q * scale) @ k.swapaxes(-1, -2)  # (B, H, T, T)
    att += causal_mask(length, att.dtype.name)
    _softmax_inplace(att)
    keep = None
    if dropout_p > 0.0:
        keep = generator.random(att.shape, dtype=np.float32) >= dropout_p
        y = (att * keep) @ v
        y *= 1.0 / (1.0 - dropout_p)
    else:
        y = att @ v  # (B, H, T, hd)
    return y, att, keep


def _attention_backward(dy, q, k, v, att, keep, dropout_p, dq, dk, dv) -> None:
    """The gradients of `_attention_forward` written into dq, dk, dv (B, H, T, hd)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    datt = dy @ v.swapaxes(-1, -2)  # (B, H, T, T)
    if keep is not None:
        inv_keep = 1.0 / (1.0 - dropout_p)
        np.matmul((att * keep).swapaxes(-1, -2), dy, out=dv)
        dv *= inv_keep
        datt *= keep
        datt *= inv_keep
    else:
        np.matmul(att.swapaxes(-1, -2), dy, out=dv)
    # softmax backward: ds = p * (dp - sum_j dp_j p_j); masked entries have p = 0
    datt -= row_dot(datt, att)
    datt *= att
    datt *= scale  # scores = scale * q k^T
    np.matmul(datt, k, out=dq)
    np.matmul(datt.swapaxes(-1, -2), q, out=dk)


def _attention_costs(ctx, batch: int, n_heads: int, length: int, head_dim: int,
                     itemsize: int, dropout: bool) -> None:
    """FLOPs and kernels of attention over n_heads query heads (K/V heads shared by
    several query heads cost nothing more: each query head multiplies its own)."""
    scores = batch * n_heads * length * length
    flops = 4 * scores * head_dim  # two matmuls
    ctx.flops_forward = flops + 5 * scores
    ctx.flops_backward = 2 * flops + 4 * scores
    ctx.kernels_forward, ctx.kernels_backward = attention_kernels(
        batch * n_heads, length, head_dim, itemsize, dropout)


class CausalSelfAttention(Function):
    """Fused causal multi-head attention (Vaswani et al. 2017, GPT-2's masking).

    qkv: (B, T, 3*H*head_dim), columns [q heads | k heads | v heads] as HF GPT-2's
    c_attn output; returns (B, T, H*head_dim) with heads merged. H is read off the width
    of qkv, so a tensor-parallel rank holding a subset of heads needs no change.
    Equal to softmax(causal(q k^T / sqrt(head_dim))) @ v per head. Saves qkv and the
    attention probabilities (B, H, T, T).
    """

    @staticmethod
    def forward(ctx, qkv, head_dim, dropout_p, generator):
        batch, length, width = qkv.shape
        if width % (3 * head_dim):
            raise ValueError(
                f"attention: qkv width {width} is not a multiple of 3 * head_dim "
                f"({3 * head_dim})"
            )
        n_heads = width // (3 * head_dim)
        work = compute_dtype(qkv.dtype)
        heads = qkv.astype(work, copy=False).reshape(batch, length, 3, n_heads, head_dim)
        q = heads[:, :, 0].transpose(0, 2, 1, 3)  # (B, H, T, hd), views
        k = heads[:, :, 1].transpose(0, 2, 1, 3)
        v = heads[:, :, 2].transpose(0, 2, 1, 3)
        y, att, keep = _attention_forward(q, k, v, dropout_p, generator)
        out = y.transpose(0, 2, 1, 3).reshape(batch, length, n_heads * head_dim)
        ctx.save_for_backward(qkv, att.astype(qkv.dtype, copy=False), keep)
        ctx.head_dim, ctx.dropout_p = head_dim, dropout_p
        _attention_costs(ctx, batch, n_heads, length, head_dim, qkv.dtype.itemsize,
                         dropout_p > 0.0)
        return out.astype(qkv.dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        qkv, att, keep = ctx.saved_tensors
        head_dim, dropout_p = ctx.head_dim, ctx.dropout_p
        batch, length, width = qkv.shape
        n_heads = width // (3 * head_dim)
        work = compute_dtype(qkv.dtype)
        heads = qkv.astype(work, copy=False).reshape(batch, length, 3, n_heads, head_dim)
        q = heads[:, :, 0].transpose(0, 2, 1, 3)
        k = heads[:, :, 1].transpose(0, 2, 1, 3)
        v = heads[:, :, 2].transpose(0, 2, 1, 3)
        att = att.astype(work, copy=False)
        dy = grad.astype(work, copy=False).reshape(batch, length, n_heads, head_dim)
        dy = dy.transpose(0, 2, 1, 3)  # (B, H, T, hd)
        grad_qkv = np.empty((batch, length, 3, n_heads, head_dim), dtype=work)
        dq = grad_qkv[:, :, 0].transpose(0, 2, 1, 3)  # views to write into
        dk = grad_qkv[:, :, 1].transpose(0, 2, 1, 3)
        dv = grad_qkv[:, :, 2].transpose(0, 2, 1, 3)
        _attention_backward(dy, q, k, v, att, keep, dropout_p, dq, dk, dv)
        return (grad_qkv.reshape(batch, length, width).astype(qkv.dtype, copy=False),
                None, None, None)


class GroupedQueryAttention(Function):
    """Causal attention with fewer key/value heads than query heads (grouped-query
    attention, Ainslie et al. 2023; Llama-2 70B, Mistral): each key/value head serves a
    group of `group` query heads, query head h reading key/value head h // group.

    qkv: (B, T, KV*(group+2)*head_dim) in Megatron-LM's layout (megatron/core/transformer/
    attention.py, `get_query_key_value_tensors`): per key/value head, its group's query
    heads, then its k, then its v. So tensor parallelism cuts qkv's columns into whole
    groups (a plain Shard: rank i holds KV/t groups), and KV is read off the width.
    Returns (B, T, KV*group*head_dim), heads merged. Saves qkv and the probabilities.
    """

    @staticmethod
    def forward(ctx, qkv, head_dim, group, dropout_p, generator):
        batch, length, width = qkv.shape
        if width % ((group + 2) * head_dim):
            raise ValueError(f"grouped-query attention: qkv width {width} is not a multiple "
                             f"of (group + 2) * head_dim = {(group + 2) * head_dim}")
        q, k, v = _grouped_heads(qkv, head_dim, group)
        n_heads = q.shape[1]
        y, att, keep = _attention_forward(q, k, v, dropout_p, generator)
        out = y.transpose(0, 2, 1, 3).reshape(batch, length, n_heads * head_dim)
        ctx.save_for_backward(qkv, att.astype(qkv.dtype, copy=False), keep)
        ctx.head_dim, ctx.group, ctx.dropout_p = head_dim, group, dropout_p
        _attention_costs(ctx, batch, n_heads, length, head_dim, qkv.dtype.itemsize,
                         dropout_p > 0.0)
        return out.astype(qkv.dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        qkv, att, keep = ctx.saved_tensors
        head_dim, group, dropout_p = ctx.head_dim, ctx.group, ctx.dropout_p
        batch, length, width = qkv.shape
        q, k, v = _grouped_heads(qkv, head_dim, group)
        n_heads, kv_heads = q.shape[1], q.shape[1] // group
        dy = grad.astype(q.dtype, copy=False).reshape(batch, length, n_heads, head_dim)
        dy = dy.transpose(0, 2, 1, 3)
        dq, dk, dv = (np.empty_like(k) for _ in range(3))
        _attention_backward(dy, q, k, v, att.astype(q.dtype, copy=False), keep, dropout_p,
                            dq, dk, dv)
        grad_qkv = np.empty((batch, length, kv_heads, group + 2, head_dim), dtype=q.dtype)
        grad_qkv[:, :, :, :group] = dq.transpose(0, 2, 1, 3).reshape(
            batch, length, kv_heads, group, head_dim)
        # each key/value head's gradient: the sum over the query heads of its group
        for i, d in ((group, dk), (group + 1, dv)):
            grad_qkv[:, :, :, i] = d.reshape(batch, kv_heads, group, length, head_dim).sum(
                axis=2).transpose(0, 2, 1, 3)
        return (grad_qkv.reshape(batch, length, width).astype(qkv.dtype, copy=False),
                None, None, None, None)


def _grouped_heads(qkv, head_dim: int, group: int):
    """(B, H, T, hd) arrays of the compute dtype from grouped-layout qkv: the query
    heads, and each key and value head repeated for the `group` query heads reading it."""
    batch, length, width = qkv.shape
    kv_heads = width // ((group + 2) * head_dim)
    work = compute_dtype(qkv.dtype)
    heads = qkv.astype(work, copy=False).reshape(batch, length, kv_heads, group + 2, head_dim)
    q = heads[:, :, :, :group].reshape(batch, length, kv_heads * group, head_dim)
    k, v = (np.repeat(heads[:, :, :, i].transpose(0, 2, 1, 3), group, axis=1)
            for i in (group, group + 1))
    return q.transpose(0, 2, 1, 3), k, v


def causal_self_attention(qkv: Tensor, head_dim: int, dropout_p: float = 0.0,
                          generator: np.random.Generator | None = None) -> Tensor:
    """Fused causal self-attention on HF-layout qkv; see `CausalSelfAttention`."""
    require_reduced(qkv, "attention")
    if dropout_p > 0.0 and generator is None:
        raise ValueError("attention dropout needs a seeded numpy Generator (generator=...)")
    return CausalSelfAttention.apply(qkv, head_dim, dropout_p, generator)


def grouped_query_attention(qkv: Tensor, head_dim: int, group: int, dropout_p: float = 0.0,
                            generator: np.random.Generator | None = None) -> Tensor:
    """Fused causal grouped-query attention on Megatron-layout qkv; see
    `GroupedQueryAttention`."""
    require_reduced(qkv, "attention")
    if dropout_p > 0.0 and generator is None:
        raise ValueError("attention dropout needs a seeded numpy Generator (generator=...)")
    return GroupedQueryAttention.apply(qkv, head_dim, group, dropout_p, generator)


# ---------------------------------------------------------------------------- loss
# The numerically stable pieces of softmax cross-entropy, on ndarrays. `CrossEntropy`
# composes them on one device; the vocabulary-parallel cross-entropy
# (minipar/parallel/tensor/vocab.py) composes the same pieces on its V/t slice of the logits,
# with a max all-reduce after `logits_max` and a sum all-reduce after
# `predicted_logits_and_sum_exp`. Megatron-LM shares its pieces the same way between its
# fused and unfused losses (`VocabParallelCrossEntropy` in
# megatron/core/tensor_parallel/cross_entropy.py: calculate_logits_max,
# calculate_predicted_logits, calculate_cross_entropy_loss, calculate_gradients).

def check_targets(targets: np.ndarray, logits_shape: tuple, vocab: int) -> None:
    """Integer targets shaped like the logits without the vocab axis, in [0, vocab)."""
    if targets.shape != logits_shape[:-1]:
        raise ValueError(f"cross_entropy: targets shape {targets.shape} does not match "
                         f"logits shape {logits_shape} without the vocab axis")
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integers, got {targets.dtype}")
    if targets.size and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"cross_entropy: targets must lie in [0, {vocab}), got values "
                         f"in [{targets.min()}, {targets.max()}]")


def logits_max(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """z: the logits as (N, V) rows, a copy in the compute dtype (fp32 for bf16 and
    fp32, fp64 for fp64), and each row's max (N,), subtracted before exp."""
    z = logits.reshape(-1, logits.shape[-1]).astype(compute_dtype(logits.dtype), copy=True)
    return z, z.max(axis=1)


def predicted_logits_and_sum_exp(z: np.ndarray, row_max: np.ndarray, targets: np.ndarray,
                                 mine: np.ndarray | None = None) -> np.ndarray:
    """Shift z by the row max, take each row's target logit, exponentiate z in place.

    targets (N,): column of each row's target in z; `mine` (N,) bool, if given: rows whose
    target is in z's columns at all (the others' target logit counts as 0). Returns
    (2, N): [sum of exp(z) over the row, target logit], one array so that a
    vocabulary-parallel loss sums both with one all-reduce.

    The row sum is `row_sum` (einsum) for whole rows and `np.sum` for a vocabulary slice
    (`mine` given): the two round differently in the last bit, and each is what its loss
    has always used, so no measured figure (README, equivalence tolerances) moves."""
    z -= row_max[:, None]
    target_logit = z[np.arange(z.shape[0]), targets]
    if mine is not None:
        target_logit = np.where(mine, target_logit, 0.0).astype(z.dtype)
    np.exp(z, out=z)
    sum_exp = row_sum(z)[:, 0] if mine is None else z.sum(axis=1)
    return np.stack([sum_exp, target_logit])


def cross_entropy_loss(z: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """mean(log-sum-exp - target logit) from exp(z) and `sums` = [sum exp, target logit];
    turns z into the softmax in place (what backward needs). Returns the loss, a scalar
    array in z's dtype."""
    total, target_logit = sums[0], sums[1]
    loss = np.mean(np.log(total) - target_logit)
    z /= total[:, None]
    return np.asarray(loss, dtype=z.dtype)


def cross_entropy_gradient(probs: np.ndarray, targets: np.ndarray, grad,
                           mine: np.ndarray | None = None) -> np.ndarray:
    """d mean loss / d z = (softmax - onehot(target)) * grad / N, in probs' dtype (computed
    in the compute dtype). With `mine`, only those rows' targets are in these columns."""
    work = compute_dtype(probs.dtype)
    g = probs.astype(work, copy=True)
    if mine is None:
        g[np.arange(g.shape[0]), targets] -= 1.0
    else:
        rows = np.nonzero(mine)[0]
        g[rows, targets[rows]] -= 1.0
    g *= np.asarray(grad, dtype=work) / g.shape[0]
    return g.astype(probs.dtype, copy=False)


class CrossEntropy(Function):
    """Mean cross-entropy of logits (..., V) against integer targets (...).

    loss = mean(logsumexp(z) - z[target]), with the max subtracted before exp
    (log-sum-exp in fp32 for bf16 and fp32, fp64 for fp64). Saves the softmax,
    because d loss / d z = (softmax(z) - onehot(target)) / N.
    """

    @staticmethod
    def forward(ctx, logits, targets):
        targets = np.asarray(targets)
        check_targets(targets, logits.shape, logits.shape[-1])
        flat_targets = targets.reshape(-1)
        z, row_max = logits_max(logits)
        sums = predicted_logits_and_sum_exp(z, row_max, flat_targets)
        loss = cross_entropy_loss(z, sums)  # z is the softmax now
        ctx.save_for_backward(z.astype(logits.dtype, copy=False), flat_targets)
        ctx.logits_shape = logits.shape
        ctx.flops_forward = 5 * z.size
        ctx.flops_backward = 2 * z.size
        return loss

    @staticmethod
    def backward(ctx, grad):
        probs, flat_targets = ctx.saved_tensors
        return cross_entropy_gradient(probs, flat_targets, grad).reshape(ctx.logits_shape), None


def cross_entropy(logits: Tensor, targets) -> Tensor:
    """Mean cross-entropy; see `CrossEntropy`. `targets` is an int array or Tensor."""
    require_reduced(logits, "cross_entropy")
    if isinstance(targets, Tensor):
        targets = targets.data
    return CrossEntropy.apply(logits, targets)


# ---------------------------------------------------------------------------- embedding
class Embedding(Function):
    """weight[idx]: rows of a (V, d) table. Backward scatter-adds the output gradient
    into the rows that were used (a token used twice gets both contributions)."""

    @staticmethod
    def forward(ctx, idx, weight):
        idx = np.asarray(idx)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"embedding: indices must be integers, got {idx.dtype}")
        vocab = weight.shape[0]
        if idx.size and (idx.min() < 0 or idx.max() >= vocab):
            raise ValueError(f"embedding: indices must lie in [0, {vocab}), got values in "
                             f"[{idx.min()}, {idx.max()}]")
        ctx.save_for_backward(idx)
        ctx.weight_shape, ctx.dtype = weight.shape, weight.dtype
        ctx.flops_backward = idx.size * weight.shape[1]
        return weight.take(idx, axis=0)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        work = compute_dtype(ctx.dtype)
        grad_weight = np.zeros(ctx.weight_shape, dtype=work)
        rows = grad.reshape(-1, ctx.weight_shape[1]).astype(work, copy=False)
        np.add.at(grad_weight, idx.reshape(-1), rows)
        return None, grad_weight.astype(ctx.dtype, copy=False)


def embedding(idx, weight: Tensor) -> Tensor:
    """Look up rows `idx` (int array (...)) of `weight` (V, d) -> (..., d)."""
    if isinstance(idx, Tensor):
        idx = idx.data
    return Embedding.apply(idx, weight)


# ---------------------------------------------------------------------------- dropout
class Dropout(Function):
    """Zero each element with probability p, scale the rest by 1/(1-p)
    (Srivastava et al. 2014, "inverted" dropout). Saves the boolean keep-mask."""

    @staticmethod
    def forward(ctx, x, p, generator):
        keep = generator.random(x.shape, dtype=np.float32) >= p
        scale = np.asarray(1.0 / (1.0 - p), dtype=x.dtype)
        ctx.save_for_backward(keep)
        ctx.scale = scale
        ctx.flops_forward = ctx.flops_backward = 2 * x.size
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


def dropout(x: Tensor, p: float, generator: np.random.Generator | None,
            training: bool = True) -> Tensor:
    """Dropout with a seeded generator; the identity (no graph node) when p == 0 or
    not training."""
    require_reduced(x, "dropout")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0.0 or not training:
        return x
    if generator is None:
        raise ValueError("dropout needs a seeded numpy Generator (generator=...)")
    return Dropout.apply(x, p, generator)

