"""Vocabulary parallelism: the split embedding, logits and cross-entropy equal their
single-device versions, and the full logits are never formed or sent."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.autograd import functional as F
from minipar.nn import GPT, Embedding, GPTConfig
from minipar.parallel.tensor.model import tensor_parallel_gpt
from minipar.parallel.tensor.vocab import (
    VocabParallelEmbedding,
    pad_vocab_size,
    vocab_parallel_cross_entropy,
)

V, D = 12, 5


def launch_tp(fn, tp, *args):
    def rank(*a):
        return fn(dist.DeviceMesh(tp=tp).tp_group(), *a)
    return dist.launch(rank, tp, *args, return_devices=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_embedding_equals_the_full_lookup_and_its_gradient(tp):
    rng = np.random.default_rng(0)
    table, idx = rng.normal(size=(V, D)), rng.integers(0, V, size=(3, 7))
    idx[0, :3] = 5  # a repeated token: its gradient rows add up
    upstream = rng.normal(size=(3, 7, D))

    def program(group):
        full = Embedding(V, D)
        full.weight.data[...] = table
        split = VocabParallelEmbedding(full, group)
        out = split(idx)
        out.backward(upstream)
        return out.data, split.weight.grad, split.vocab_start

    expected_grad = np.zeros((V, D))
    np.add.at(expected_grad, idx.reshape(-1), upstream.reshape(-1, D))
    results, _ = launch_tp(program, tp)
    rows = V // tp
    for i, (out, grad, start) in enumerate(results):
        assert start == i * rows
        np.testing.assert_array_equal(out, table[idx])
        np.testing.assert_allclose(grad, expected_grad[i * rows:(i + 1) * rows], rtol=1e-14)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_cross_entropy_equals_the_full_one_and_sends_no_logits(tp):
    """Loss and d loss / d logits equal F.cross_entropy on the full logits; the only
    communication is one max and one sum all-reduce of per-token numbers, forward."""
    rng = np.random.default_rng(1)
    b, s = 2, 4
    logits = rng.normal(scale=3.0, size=(b, s, V))
    targets = rng.integers(0, V, size=(b, s))
    full = Tensor(logits, requires_grad=True)
    expected = F.cross_entropy(full, targets)
    expected.backward()

    def program(group):
        rank, rows = dist.get_rank(group), V // group.size
        mine = Tensor(logits[..., rank * rows:(rank + 1) * rows], requires_grad=True)
        with dist.phase("forward"):
            loss = vocab_parallel_cross_entropy(mine, targets, rank * rows, group)
        with dist.phase("backward"):
            loss.backward()
        return float(loss.data), mine.grad

    results, devices = launch_tp(program, tp)
    rows = V // tp
    for i, (loss, grad) in enumerate(results):
        assert loss == pytest.approx(float(expected.data), rel=1e-14)
        np.testing.assert_allclose(grad, full.grad[..., i * rows:(i + 1) * rows], rtol=1e-12,
                                   atol=1e-16)
    for device in devices:
        calls = [(r.phase, r.op, r.sent_bytes) for r in device.comm.records]
        ring = 2 * (tp - 1) * b * s * 8 // tp  # an all-reduce of b*s fp64 numbers
        assert calls == [("forward", "all_reduce", ring), ("forward", "all_reduce", 2 * ring)]


def test_the_loss_is_the_same_on_every_rank_and_logits_are_only_gathered_on_request():
    config = GPTConfig(vocab_size=V, seq_len=4, n_layer=1, n_head=2, d_model=8)
    rng = np.random.default_rng(2)
    idx, targets = rng.integers(0, V, (2, 4)), rng.integers(0, V, (2, 4))
    reference = GPT(config, seed=0)
    expected_loss, expected_logits = reference(idx, targets), reference(idx)

    def program(group):
        model = tensor_parallel_gpt(config, 0, "fp64", group)
        return float(model(idx, targets).data), model(idx).data

    results, _ = launch_tp(program, 2)
    for loss, logits in results:
        assert loss == pytest.approx(float(expected_loss.data), rel=1e-14)
        np.testing.assert_allclose(logits, expected_logits.data, rtol=1e-12)


def test_pad_vocab_size_rounds_up_to_a_multiple_of_tp():
    assert [pad_vocab_size(52, t) for t in (1, 2, 4, 8, 3)] == [52, 52, 52, 56, 54]


def test_an_embedding_that_does_not_split_is_refused_with_the_padded_size():
    def program(group):
        VocabParallelEmbedding(Embedding(10, 3), group)
    with pytest.raises(ValueError, match="vocab_size=10 .* --vocab-size 12"):
        launch_tp(program, 4)
