"""The split backward of zero-bubble pipelines (engine.backward_input and its W): B gives
the stage input's gradient at once, W the weight gradients later, and together they are
bit-for-bit the unsplit backward, with what W needs booked in the ledger until it runs."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd import Tensor, use_device
from minipar.autograd.engine import backward_input
from minipar.distributed.memory import MemoryLedger
from minipar.nn import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=17, seq_len=8, n_layer=2, n_head=2, d_model=16)


class LedgerDevice:
    """What the engine reads from a device: a ledger, FLOP counting, a phase."""

    def __init__(self):
        self.memory = MemoryLedger()
        self.phase = "forward"
        self.flops = {"forward": 0, "backward": 0}

    def compute(self, flops, kind):
        self.flops[kind] += flops


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 17, (3, 8)), rng.integers(0, 17, (3, 8))


def stage_forward(model, x):
    """A middle pipeline stage: the blocks on a received activation x (a leaf)."""
    for block in model.h:
        x = block(x)
    return x


def grads(model):
    return {name: None if p.grad is None else p.grad.copy()
            for name, p in model.named_parameters()}


def test_b_then_w_equals_the_unsplit_backward_bit_for_bit_on_a_middle_stage():
    model = GPT(CONFIG, seed=1)
    rng = np.random.default_rng(2)
    x0, g = rng.standard_normal((3, 8, 16)), rng.standard_normal((3, 8, 16))
    x = Tensor(x0.copy(), requires_grad=True)
    stage_forward(model, x).backward(g)
    want, want_x = grads(model), x.grad.copy()
    model.zero_grad()

    x = Tensor(x0.copy(), requires_grad=True)
    w = backward_input(stage_forward(model, x), g, [x])
    np.testing.assert_array_equal(x.grad, want_x)  # what the previous stage waits for
    assert all(p.grad is None for p in model.parameters())  # weights wait for W
    w.run()
    got = grads(model)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_whole_model_split_at_its_embedding_output_equals_the_unsplit_one():
    # The first stage's B stops at the embedding output; W holds the embedding's
    # scatter-add and the tied head (wte gets two contributions, summed in W).
    model = GPT(CONFIG, seed=3)
    idx, targets = batch()
    loss = model(idx, targets)
    loss.backward()
    want = grads(model)
    model.zero_grad()
    for _ in range(2):  # and accumulating over two micro-batches, in order
        x = model.embed(idx)
        loss = model.head(stage_forward(model, x), targets)
        backward_input(loss, np.ones(()), [x]).run()
    got = grads(model)
    for name in want:
        np.testing.assert_array_equal(got[name], 2 * want[name], err_msg=name)


def test_w_keeps_its_arrays_booked_until_it_runs_and_the_flops_add_up():
    model = GPT(CONFIG, seed=1)
    rng = np.random.default_rng(2)
    x0, g = rng.standard_normal((3, 8, 16)), rng.standard_normal((3, 8, 16))
    unsplit, split = LedgerDevice(), LedgerDevice()
    with use_device(unsplit):
        x = Tensor(x0, requires_grad=True)
        out = stage_forward(model, x)
        saved = unsplit.memory.current["activations"]
        out.backward(g)
    model.zero_grad()
    with use_device(split):
        x = Tensor(x0, requires_grad=True)
        w = backward_input(stage_forward(model, x), g, [x])
        after_b = split.memory.current["activations"]
        b_flops = split.flops["backward"]
        w.run()
    assert saved > 0 and unsplit.memory.current["activations"] == 0
    # after B: the Linears' inputs and output gradients, less than forward saved
    # (attention probabilities, GELU and LayerNorm inputs are gone) but not nothing
    assert 0 < after_b < saved
    assert split.memory.current["activations"] == 0  # W released everything
    # W pays the weight GEMMs: B + W = the unsplit backward, and W is a real share
    assert split.flops["backward"] == unsplit.flops["backward"]
    assert 0.3 < (split.flops["backward"] - b_flops) / split.flops["backward"] < 0.6


def test_w_runs_once():
    model = GPT(CONFIG)
    x = Tensor(np.ones((1, 8, 16)), requires_grad=True)
    w = backward_input(stage_forward(model, x), np.ones((1, 8, 16)), [x])
    w.run()
    with pytest.raises(RuntimeError, match="already ran"):
        w.run()
