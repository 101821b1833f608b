"""A run whose loss or gradients become NaN or inf stops at that step, naming the step
and the first non-finite tensor, before the optimizer writes NaN into the weights."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from minipar.errors import TrainingDiverged
from minipar.train import TrainConfig, train

loop = importlib.import_module("minipar.train.loop")
# NumPy warns as the inf update turns weights into NaN: that is the point of these tests.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
SMALL = dict(seq_len=8, n_layer=1, d_model=16, n_head=2, micro_batch_size=2, steps=4)


def poisoned_learning_rate(bad_step: int, value: float):
    """The schedule, except that step `bad_step` updates with `value` (inf: every weight
    the update touches becomes inf or NaN, as an overflow would make it)."""
    schedule = loop.learning_rate

    def learning_rate(config, step):
        return value if step == bad_step else schedule(config, step)

    return learning_rate


@pytest.mark.parametrize("layout", [dict(), dict(dp=2, zero=2), dict(pp=2, n_layer=2,
                                                                      grad_accum_steps=2)])
def test_non_finite_weights_stop_the_next_step_and_are_named(monkeypatch, layout):
    monkeypatch.setattr(loop, "learning_rate", poisoned_learning_rate(1, float("inf")))
    with pytest.raises(TrainingDiverged, match=r"diverged at step 2: loss nan.*first "
                                               r"non-finite tensor is parameter \S+") as info:
        train(TrainConfig(precision="fp32", **{**SMALL, **layout}))
    assert info.value.step == 2 and info.value.tensor.startswith("parameter ")


def test_a_non_finite_gradient_is_named(monkeypatch):
    """Weights still finite, this step's backward overflowed: the gradient is named."""
    real = loop.build_rank_model

    def overflowing(config, mesh, start=None):
        rank = real(config, mesh, start)
        forward_backward = rank.forward_backward

        def poisoned(micro_batches):
            loss = forward_backward(micro_batches)
            name, param = rank.named_parameters()[-1]
            if param.grad is not None:
                param.grad[...] = np.inf
            return loss

        rank.forward_backward = poisoned
        return rank

    monkeypatch.setattr(loop, "build_rank_model", overflowing)
    with pytest.raises(TrainingDiverged, match=r"step 0: .*gradient norm (inf|nan); the "
                                               r"first non-finite tensor is gradient of "):
        train(TrainConfig(precision="fp64", grad_clip=0.0, **SMALL))


def test_the_cli_stops_a_diverged_run_in_one_line(monkeypatch, capsys):
    from minipar import cli

    monkeypatch.setattr(loop, "learning_rate", poisoned_learning_rate(0, float("inf")))
    status = cli.main(["train", "--quiet", "--seq-len", "8", "--d-model", "16", "--n-layer",
                       "1", "--n-head", "2", "--steps", "3"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "diverged at step 1" in err
