"""Data: the corpus, the tokenizer and deterministic batching."""

import numpy as np
import pytest

from minipar.errors import ConfigError
from minipar.train.corpus import generate_corpus, load_corpus
from minipar.train.data import CharTokenizer, corpus_stream, micro_batch, synthetic_stream


def test_committed_corpus_is_what_the_generator_writes():
    assert load_corpus() == generate_corpus()


def test_corpus_is_tens_of_kilobytes_of_text():
    text = load_corpus()
    assert 20_000 <= len(text.encode()) <= 100_000
    assert text.count(" ") > len(text) / 10  # words, not noise


def test_tokenizer_round_trips():
    tokenizer = CharTokenizer("hello world")
    ids = tokenizer.encode("low")
    assert tokenizer.decode(ids) == "low"
    assert tokenizer.vocab_size == len(set("hello world"))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tokenizer.encode("z")


def test_batches_depend_only_on_seed_and_step():
    stream, _ = corpus_stream()
    a = stream.global_batch(step=3, size=8, seq_len=16, seed=1)
    b = stream.global_batch(step=3, size=8, seq_len=16, seed=1)
    c = stream.global_batch(step=4, size=8, seq_len=16, seed=1)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_targets_are_inputs_shifted_by_one():
    stream, _ = corpus_stream()
    x, y = stream.global_batch(step=0, size=4, seq_len=10, seed=0)
    assert x.shape == y.shape == (4, 10)
    assert np.array_equal(x[:, 1:], y[:, :-1])


def test_micro_batches_of_all_ranks_tile_the_global_batch_exactly_once():
    x = np.arange(24)[:, None] * np.ones((1, 3), dtype=int)
    seen = []
    for rank in range(3):
        for k in range(2):
            xs, _ = micro_batch(x, x, dp_rank=rank, micro_step=k, micro_batch_size=4,
                                grad_accum_steps=2)
            seen.extend(xs[:, 0].tolist())
    assert sorted(seen) == list(range(24))
    # rank-major: DP rank 1 owns the second contiguous third
    xs, _ = micro_batch(x, x, dp_rank=1, micro_step=0, micro_batch_size=4, grad_accum_steps=2)
    assert xs[:, 0].tolist() == [8, 9, 10, 11]


def test_synthetic_task_follows_its_markov_chain():
    stream = synthetic_stream(vocab_size=16, length=5000)
    pairs = {(int(a), int(b)) for a, b in zip(stream.tokens[:-1], stream.tokens[1:], strict=True)}
    successors = {a: {b for (x, b) in pairs if x == a} for a, _ in pairs}
    assert all(len(s) <= 3 for s in successors.values())


def test_too_long_sequences_name_the_flag():
    stream = synthetic_stream(vocab_size=8, length=50)
    with pytest.raises(ConfigError, match="--seq-len"):
        stream.global_batch(step=0, size=2, seq_len=64, seed=0)


def test_micro_batches_are_copies_not_views_of_the_global_batch():
    x = np.arange(12).reshape(6, 2)
    xs, ys = micro_batch(x, x, dp_rank=1, micro_step=0, micro_batch_size=1, grad_accum_steps=1)
    assert xs.base is None and ys.base is None
    assert xs.nbytes == x.nbytes // 6


@pytest.mark.parametrize("vocab_size", [2, 10**6])
def test_the_synthetic_task_refuses_a_vocabulary_it_cannot_draw(vocab_size):
    """Each token's 3 successors come from a permutation of all V: V = 2 ended in an
    IndexError, V = 10**6 took V^2 work (the run never started)."""
    with pytest.raises(ConfigError, match="the synthetic task needs 3 to 8,192 tokens"):
        synthetic_stream(vocab_size)
