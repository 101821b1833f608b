"""Layers: `Linear`, `LayerNorm`, `Embedding`, `Dropout`.

Weights use Hugging Face GPT-2's layouts: `Linear.weight` is (in_features, out_features)
and is applied as x @ W (HF's Conv1D), `Embedding.weight` is (num_embeddings, dim).
A standalone layer initialises its weights with normal(0, 0.02) from `generator`
(default seed 0); `GPT` overwrites them with its per-name initialisation.
"""

from __future__ import annotations

import numpy as np

from minipar.autograd import functional as F
from minipar.nn.module import Module, Parameter


def _normal(generator, shape, std, dtype) -> np.ndarray:
    rng = generator if generator is not None else np.random.default_rng(0)
    return rng.normal(0.0, std, size=shape).astype(dtype)


class Linear(Module):
    """y = x @ weight + bias; weight (in_features, out_features), bias (out_features,)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype=np.float64, generator: np.random.Generator | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_normal(generator, (in_features, out_features), 0.02, dtype))
        self.bias = Parameter(np.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    """LayerNorm over the last axis with affine weight (ones) and bias (zeros)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, dtype=np.float64):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(np.ones(normalized_shape, dtype=dtype))
        self.bias = Parameter(np.zeros(normalized_shape, dtype=dtype))

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(Module):
    """A (num_embeddings, embedding_dim) table; `forward(idx)` looks rows up."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype=np.float64,
                 generator: np.random.Generator | None = None):
        super().__init__()
        self.weight = Parameter(_normal(generator, (num_embeddings, embedding_dim), 0.02,
                                        dtype))

    def forward(self, idx):
        return F.embedding(idx, self.weight)


class Dropout(Module):
    """Dropout with probability `p`, drawing masks from a seeded `generator`;
    the identity in eval mode or when p == 0."""

    def __init__(self, p: float = 0.0, generator: np.random.Generator | None = None):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p, self.generator = p, generator

    def forward(self, x):
        return F.dropout(x, self.p, self.generator, self.training)
