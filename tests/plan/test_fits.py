"""Runs too big for this machine are refused before anything is allocated, with the
planner's estimate in the message; the estimate is the sum of what the ranks measured."""

from __future__ import annotations

import importlib

import pytest

import minipar
from minipar import distributed as dist
from minipar.errors import ConfigError
from minipar.plan.fits import GiB, check_fits, run_bytes
from minipar.train import TrainConfig, train

LAPTOP = 23 * GiB


@pytest.mark.parametrize("setting, value", [
    ("seq_len", 1_000_000_000), ("micro_batch_size", 1_000_000_000),
    ("d_model", 10_000_000), ("vocab_size", 100_000_000),
])
def test_the_issues_sizes_are_refused_with_the_estimate(setting, value):
    with pytest.raises(ConfigError, match=rf"^--{setting.replace('_', '-')}: this run needs "
                                          r"~[\d,]+ GiB .*, this machine has 23 GiB") as info:
        check_fits(TrainConfig(**{setting: value}), available=LAPTOP)
    assert info.value.setting == setting


@pytest.mark.parametrize("setting, value", [("n_layer", 100_000), ("n_layer", 10**12),
                                            ("moe_num_experts", 10**12)])
def test_depths_and_expert_counts_past_minipars_limit_are_refused_before_any_estimate(
        setting, value):
    """--n-layer 10**12 hung the estimate (a list per layer); the limit says it first."""
    with pytest.raises(ConfigError, match=rf"^--{setting.replace('_', '-')}: must be at most "
                                          r"4,096 \(minipar's limit"):
        TrainConfig(**{setting: value})


def test_the_vocabulary_example_of_the_issue():
    with pytest.raises(ConfigError, match="needs ~119 GiB"):
        check_fits(TrainConfig(vocab_size=100_000_000), available=LAPTOP)


@pytest.mark.parametrize("layout", [
    dict(), dict(dp=2, zero=1), dict(tp=2, precision="fp64", check=True),
    dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=4, n_layer=2),
    dict(dp=2, zero=3, precision="bf16-mixed"),
])
def test_the_estimate_is_what_the_ranks_hold(layout):
    """The estimate against the ledgers: the sum over ranks of each one's measured peak
    (the planner is exact for these, a few % above with pipelines and ZeRO-3 buffers)."""
    config = TrainConfig(steps=2, **layout)
    report = train(config)
    measured = sum(rank["memory"]["peak_total"] for rank in report.ranks)
    estimated, _ = run_bytes(config.replace(vocab_size=report.config["vocab_size"]))
    assert measured <= estimated <= 1.05 * measured


def test_minipar_train_and_the_cli_refuse_before_allocating(monkeypatch, capsys):
    loop = importlib.import_module("minipar.train.loop")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the run started before its size was checked")

    monkeypatch.setattr(loop, "_launch", must_not_run)
    with pytest.raises(ConfigError, match="--seq-len: this run needs"):
        minipar.train(TrainConfig(seq_len=1_000_000_000))
    with pytest.raises(ConfigError, match="--micro-batch-size: this run needs"):
        minipar.train(micro_batch_size=1_000_000_000, steps=1)
    from minipar import cli

    assert cli.main(["train", "--quiet", "--d-model", "10000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--d-model: this run needs ~" in err


def test_a_world_above_the_maximum_is_refused_before_starting_threads():
    with pytest.raises(ConfigError, match=r"^--dp: .* = 100000 virtual ranks, above "
                                          rf"minipar's maximum of {dist.MAX_WORLD_SIZE}"):
        TrainConfig(dp=100_000)
    with pytest.raises(ValueError, match="above minipar's maximum"):
        dist.launch(lambda: None, dist.MAX_WORLD_SIZE + 1)
    assert len(dist.launch(dist.get_rank, dist.MAX_WORLD_SIZE)) == dist.MAX_WORLD_SIZE
