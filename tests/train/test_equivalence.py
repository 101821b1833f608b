"""`--check`: every dp x ZeRO layout trains like one device, and a bug is located at the
first step, tensor and rank where it shows."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from minipar.parallel.data import ddp as data_parallel
from minipar.parallel.state import bucket_pieces
from minipar.parallel.zero import sharded as zero_engine
from minipar.train import TrainConfig, train, validate_report
from minipar.train.equivalence import compare_runs, reference_config

# grad_clip 0.05 is below every step's gradient norm: clipping is active throughout.
SMALL = dict(seq_len=8, n_layer=1, d_model=16, n_head=2, micro_batch_size=2, steps=3,
             grad_clip=0.05)


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_fp64_agrees_with_one_device_to_1e_10(dp, zero, accum):
    report = train(TrainConfig(dp=dp, zero=zero, grad_accum_steps=accum, precision="fp64",
                               check=True, **SMALL))
    check = report.equivalence
    assert check["passed"], check["first_mismatch"]
    assert check["tolerance"] == 1e-10
    assert check["max_rel_param_diff_per_step"] <= 1e-10
    assert check["max_abs_loss_diff"] <= 1e-10 * max(report.losses)
    assert all(s["grad_norm"] > SMALL["grad_clip"] for s in report.steps)  # clipping on


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-2), ("bf16-mixed", 5e-2)])
@pytest.mark.parametrize("dp, zero, accum", [(2, 0, 3), (4, 2, 1), (3, 3, 2)])
def test_fp32_and_bf16_agree_within_their_looser_tolerances(precision, tolerance, dp, zero,
                                                            accum):
    report = train(TrainConfig(dp=dp, zero=zero, grad_accum_steps=accum, precision=precision,
                               check=True, **{**SMALL, "steps": 5}))
    check = report.equivalence
    assert check["passed"], check["first_mismatch"]
    assert check["tolerance"] == tolerance
    assert check["relative_to"] == ("model" if precision == "bf16-mixed" else "tensor")


@pytest.mark.parametrize("schedule, v", [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2),
                                         ("dualpipe-v", 2)])
@pytest.mark.parametrize("zero", [0, 1])
def test_a_split_backward_with_checkpointed_layers_reduces_every_bucket(schedule, v, zero):
    """A checkpointed layer's recomputed backward makes its weight gradients in the I,
    not the W: data parallelism's buckets are reduced during both of the last
    micro-batch's, small buckets and an untied head included, and the run is one
    device's."""
    report = train(TrainConfig(dp=2, pp=2, zero=zero, schedule=schedule, virtual_stages=v,
                               recompute_granularity="full", bucket_size_mb=0.01,
                               tie_embeddings=False, grad_accum_steps=4, precision="fp64",
                               check=True, **{**SMALL, "n_layer": 4, "steps": 2}))
    assert report.equivalence["passed"], report.equivalence["first_mismatch"]


def test_the_reference_sees_the_same_micro_batches():
    config = TrainConfig(dp=4, grad_accum_steps=3, micro_batch_size=2)
    reference = reference_config(config)
    assert (reference.dp, reference.zero, reference.world_size) == (1, 0, 1)
    assert (reference.micro_batch_size, reference.grad_accum_steps) == (2, 12)
    assert reference.global_batch_size == config.global_batch_size == 24


def test_the_equivalence_section_is_in_the_report_and_its_schema():
    report = train(TrainConfig(dp=2, zero=3, precision="fp64", check=True, **SMALL))
    data = json.loads(report.to_json())
    validate_report(data)
    section = data["equivalence"]
    assert section["reference"] == "single-device"
    assert {"max_abs_loss_diff", "max_rel_param_diff", "tolerance", "passed",
            "first_mismatch"} <= set(section)


# ------------------------------------------------------------------ locating a bug
def test_a_corrupted_replica_is_named_by_step_tensor_and_rank(monkeypatch):
    step = data_parallel.DataParallel.step

    def faulty_step(self, lr):
        step(self, lr)
        if data_parallel.dist.get_rank() == 1 and self.step_count == 2:  # after the second step
            dict(zip(self.names, self.params, strict=True))["h.0.mlp.c_fc.bias"].data[3] += 1

    monkeypatch.setattr(data_parallel.DataParallel, "step", faulty_step)
    report = train(TrainConfig(dp=3, precision="fp64", check=True, **SMALL))
    check = report.equivalence
    assert not check["passed"]
    first = check["first_mismatch"]
    assert (first["step"], first["tensor"], first["rank"]) == (1, "h.0.mlp.c_fc.bias", 1)
    # without check, the diverged replicas make the consolidation fail loudly
    from minipar.errors import CheckpointError

    with pytest.raises(CheckpointError, match="rank 1: param of h.0.mlp.c_fc.bias differs"):
        train(TrainConfig(dp=3, precision="fp64", **SMALL))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_corrupted_shard_names_the_rank_that_owns_it(monkeypatch, zero):
    """With ZeRO-1/2 a wrong shard reaches every rank through the all-gather; the check
    still blames its owner."""
    complete = zero_engine.ZeroEngine._complete
    corrupted = []

    def faulty_complete(self, sb, flat, work):
        complete(self, sb, flat, work)
        if self.rank == 2 and self.step_count == 1 and sb.bucket.index == 0 and not corrupted:
            sb.grad_shard[0] += 1e3  # a wrong gradient element before the second update
            corrupted.append(bucket_pieces(sb.bucket, "param", sb.param_shard, self.rank)[0].name)

    monkeypatch.setattr(zero_engine.ZeroEngine, "_complete", faulty_complete)
    # (no clipping: the global norm would carry the error into every rank's update)
    report = train(TrainConfig(dp=4, zero=zero, precision="fp64", check=True,
                               **{**SMALL, "grad_clip": 0.0}))
    first = report.equivalence["first_mismatch"]
    assert (first["step"], first["tensor"], first["rank"]) == (1, corrupted[0], 2)
    assert first["owned"]


def test_a_loss_that_differs_first_is_named_loss():
    steps = [{"step": s, "loss": 1.0} for s in range(3)]
    wrong = [{"step": s, "loss": 1.0 + (s >= 1)} for s in range(3)]
    state = {"w": np.ones(3)}
    clean = {"max_rel_param_diff": 0.0, "first_mismatch": None}
    section = compare_runs(wrong, steps, state, state, [clean], 1e-10)
    assert not section["passed"]
    assert section["first_mismatch"]["step"] == 1
    assert section["first_mismatch"]["tensor"] == "loss"
    assert section["max_abs_loss_diff"] == 1.0


@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16-mixed"])
def test_gradients_summed_instead_of_averaged_fail_the_check(monkeypatch, precision):
    """Adam's update hardly sees a constant factor on the gradient and clipping rescales
    it, so this bug barely moves the parameters; the gradient norm (x dp) catches it."""
    real_all_reduce = data_parallel.dist.all_reduce

    def forgets_to_average(x, op="sum", group=None, **kwargs):
        return real_all_reduce(x, op="sum" if op == "avg" else op, group=group, **kwargs)

    monkeypatch.setattr(data_parallel.dist, "all_reduce", forgets_to_average)
    report = train(TrainConfig(dp=2, check=True, precision=precision,
                               **{**SMALL, "grad_clip": 1.0}))
    equivalence = report.equivalence
    assert not equivalence["passed"]
    assert equivalence["first_mismatch"]["step"] == 0
    assert equivalence["max_rel_grad_norm_diff"] > 0.5   # the norm is dp = 2 times too big
    if precision != "fp64":  # fp64's tight tolerance also sees the parameters move
        assert equivalence["first_mismatch"]["tensor"] == "grad_norm"


# ------------------------------------------------------------------ determinism, CLI
def test_the_same_config_twice_gives_bit_identical_reports():
    config = TrainConfig(dp=4, zero=3, grad_accum_steps=2, bucket_size_mb=1e-3,
                         precision="fp32", check=True, **SMALL)
    assert train(config).to_json() == train(config).to_json()


def test_cli_train_with_check_writes_the_equivalence_section(tmp_path):
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "minipar.cli", "train", "--dp", "4", "--zero", "2", "--check",
         "--json", str(out), "--steps", "3", "--seq-len", "8", "--d-model", "16",
         "--n-layer", "1", "--micro-batch-size", "2"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "equivalence with single-device training: passed" in result.stdout
    report = json.loads(out.read_text())
    validate_report(report)
    assert report["config"]["check"] is True and report["config"]["zero"] == 2
    assert report["equivalence"]["passed"] is True
