"""Layers: `Linear`, `LayerNorm`, `Embedding`, `Dropout`, `Identity`, `CrossEntropyLoss`.

Weights use Hugging Face GPT-2's layouts: `Linear.weight` is (in_features, out_features)
and is applied as x @ W (HF's Conv1D), `Embedding.weight` is (num_embeddings, dim).
A standalone layer initialises its weights with normal(0, 0.02) from `generator`
(default seed 0); `GPT` overwrites them with its per-name initialisation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

from minipar.autograd import functional as F
from minipar.nn.module import Module, Parameter


class InitialDraws:
    """Initial weights that are a pure function of their key, drawn once and kept
    (read-only) for the next layer or model that asks, up to `budget` bytes (least
    recently used dropped first).

    Why: every virtual rank builds the full model before keeping its slice (as
    Megatron-LM's `_initialize_affine_weight_cpu` draws the full master weight), so an
    8-rank run drew the same weights 8 times, and each explorer setting (minipar.viz)
    again: ~40% of a small model's measured training step. The values are the same
    draws; only the drawing is shared. Thread-safe (the ranks are threads)."""

    def __init__(self, budget: int = 64 * 2**20) -> None:
        self.budget = budget
        self._arrays: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable, draw: Callable[[], np.ndarray]) -> np.ndarray:
        """draw() (read-only), the kept array if this key was drawn before."""
        with self._lock:
            if key in self._arrays:
                self._arrays.move_to_end(key)
                return self._arrays[key]
        array = draw()
        array.setflags(write=False)
        with self._lock:
            if key not in self._arrays and array.nbytes <= self.budget:
                self._arrays[key] = array
                self._bytes += array.nbytes
                while self._bytes > self.budget:
                    _, dropped = self._arrays.popitem(last=False)
                    self._bytes -= dropped.nbytes
        return array

    def clear(self) -> None:
        with self._lock:
            self._arrays.clear()
            self._bytes = 0


INITIAL_DRAWS = InitialDraws()


def _normal(generator, shape, std, dtype) -> np.ndarray:
    if generator is not None:
        return generator.normal(0.0, std, size=shape).astype(dtype)
    # The default generator is a fresh default_rng(0): the draw depends on the shape
    # alone, so it is drawn once per shape (GPT then overwrites it by name anyway).
    drawn = INITIAL_DRAWS.get(("layers default", tuple(shape), std),
                              lambda: np.random.default_rng(0).normal(0.0, std, size=shape))
    return drawn.astype(dtype)  # a copy: the layer owns its weights


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


class Identity(Module):
    """x -> x. Holds a place in a model that a parallel strategy swaps for its own module
    (GPT's scatter into the sequence-parallel region: minipar/parallel/tensor/sequence.py)."""

    def forward(self, x):
        return x


class CrossEntropyLoss(Module):
    """Mean cross-entropy of logits (..., V) against integer targets (...)."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets)
