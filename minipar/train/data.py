"""Data: a character tokenizer, the built-in corpus, a synthetic task, and batching.

Batching is a pure function of (seed, step): the global batch of step s is the same
whatever the parallel layout, so a parallel run and its single-device reference see the
same tokens, and a resumed run needs no saved data position beyond the step number.

How a global batch of G = micro_batch_size x grad_accum_steps x dp sequences is split
(rank-major, like PyTorch's DistributedSampler giving each replica a contiguous shard):

    rows [r*M*A : (r+1)*M*A]      belong to data-parallel rank r      (M = micro, A = accum)
    of those, rows [k*M : (k+1)*M] are its micro-batch k
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from minipar.errors import ConfigError
from minipar.train.corpus import load_corpus


class CharTokenizer:
    """Characters <-> integer ids; the vocabulary is the sorted set of characters."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.array([self.index[ch] for ch in text], dtype=np.int64)
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass
class TokenStream:
    """A long 1-D array of token ids from which training windows are drawn."""

    tokens: np.ndarray  # (N,) int64
    vocab_size: int
    name: str
    # The last global batches drawn: every rank of a launch asks for the same one, and
    # drawing it is O(world) work per rank (read-only arrays; micro_batch copies rows)
    _drawn: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def global_batch(self, step: int, size: int, seq_len: int, seed: int):
        """The global batch of `step`: (inputs, targets), each int64 of shape (size, seq_len),
        read-only.

        Window starts are drawn from a generator seeded by (seed, step) only."""
        key = (step, size, seq_len, seed)
        batch = self._drawn.get(key)
        if batch is None:
            batch = self._draw(step, size, seq_len, seed)
            last = list(self._drawn.items())[-1:]  # ranks are at most a step apart
            self._drawn = {**dict(last), key: batch}
        return batch

    def _draw(self, step: int, size: int, seq_len: int, seed: int):
        limit = len(self.tokens) - seq_len - 1
        if limit < 1:
            raise ConfigError("seq_len", f"{seq_len} is too long for the {self.name} data "
                              f"({len(self.tokens)} tokens); use a shorter one")
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, limit, size=size)
        window = starts[:, None] + np.arange(seq_len + 1)[None, :]
        chunk = self.tokens[window]
        chunk.flags.writeable = False
        return chunk[:, :-1], chunk[:, 1:]


def corpus_stream() -> tuple[TokenStream, CharTokenizer]:
    """The built-in corpus as a token stream, with its tokenizer."""
    tokens, tokenizer = _encoded_corpus()
    return TokenStream(tokens, tokenizer.vocab_size, "corpus"), tokenizer


@functools.lru_cache(maxsize=1)
def _encoded_corpus() -> tuple[np.ndarray, CharTokenizer]:
    """The corpus encoded once per process (~13 ms, paid by every run of an explorer
    otherwise); read-only, since every stream shares it."""
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    tokens.flags.writeable = False
    return tokens, tokenizer


SYNTHETIC_MAX_VOCAB = 8192


def synthetic_stream(vocab_size: int = 32, length: int = 20_000, seed: int = 0) -> TokenStream:
    """A learnable synthetic task: tokens from a fixed random first-order Markov chain in
    which each token has only 3 likely successors. Loss starts near ln(V) and can fall to
    about ln(3); no text needed, a vocabulary of 3 to SYNTHETIC_MAX_VOCAB tokens (each
    token's successors come from a permutation of all V: V^2 work, 0.5 s at the most)."""
    if not 3 <= vocab_size <= SYNTHETIC_MAX_VOCAB:
        raise ConfigError("vocab_size", f"the synthetic task needs 3 to "
                          f"{SYNTHETIC_MAX_VOCAB:,} tokens (3 likely successors each, drawn "
                          f"from all V), got {vocab_size:,}; use --data corpus for a fixed one")
    rng = np.random.default_rng([seed, 2024])
    successors = np.stack([rng.permutation(vocab_size)[:3] for _ in range(vocab_size)])
    choices = rng.integers(0, 3, size=length)
    tokens = np.empty(length, dtype=np.int64)
    tokens[0] = 0
    for i in range(1, length):
        tokens[i] = successors[tokens[i - 1], choices[i]]
    return TokenStream(tokens, vocab_size, "synthetic")


def make_stream(data: str, vocab_size: int | None = None) -> TokenStream:
    """The token stream named by TrainConfig.data."""
    if data == "corpus":
        stream, _ = corpus_stream()
        if vocab_size is not None and vocab_size < stream.vocab_size:
            raise ConfigError("vocab_size", f"{vocab_size} is smaller than the corpus "
                              f"vocabulary ({stream.vocab_size} characters); omit it or raise it")
        if vocab_size is not None:  # a larger vocabulary is allowed (unused ids, like padding)
            stream = TokenStream(stream.tokens, vocab_size, stream.name)
        return stream
    if data == "synthetic":
        return synthetic_stream(vocab_size or 32)
    raise ConfigError("data", f"unknown data {data!r}; use 'corpus' or 'synthetic'")


def micro_batch(inputs: np.ndarray, targets: np.ndarray, *, dp_rank: int, micro_step: int,
                micro_batch_size: int, grad_accum_steps: int):
    """Rows of the global batch that DP rank `dp_rank` uses in micro-step `micro_step`
    (see the module docstring). Returns (inputs, targets), each (micro_batch_size, T)."""
    start = (dp_rank * grad_accum_steps + micro_step) * micro_batch_size
    rows = slice(start, start + micro_batch_size)
    # Copies, as if each rank had loaded its own rows: a view would keep the whole global
    # batch alive, and the memory ledger (which counts a view's whole buffer) would book
    # it as this rank's activations.
    return inputs[rows].copy(), targets[rows].copy()
