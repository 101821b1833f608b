"""The equivalence matrix (`minipar check`): its representative part passes, a planted
bug is located, and the table says where. The whole grid is `minipar check`'s job."""

from __future__ import annotations

import importlib

import pytest

from minipar.parallel.pipeline.schedules.registry import schedule_names
from minipar.parallel.pipeline.tied_embedding import TiedEmbedding
from minipar.train.grid import GRID, REPRESENTATIVE, Case, run_case, run_grid
from minipar.viz.tables import grid_table


def test_the_grid_covers_every_axis_and_the_required_layouts():
    names = {case.name for case in GRID}
    assert {"dp2 tp2 pp2 zero1 (8 ranks)", "dp3 tp1 pp2 zero1 (odd, 6 ranks)"} <= names
    configs = [case.config() for case in GRID if not case.refused]  # (some refuse to build)
    assert {c.zero for c in configs} == {0, 1, 2, 3}
    # every registered schedule is trained
    assert {c.schedule for c in configs if c.pp > 1} == set(schedule_names())
    assert any(c.sequence_parallel for c in configs)
    assert any(c.recompute.label == "full" for c in configs)  # every layer recomputed
    assert all(c.precision == "fp64" and c.check for c in configs)
    assert set(REPRESENTATIVE) <= names


def test_the_representative_cases_match_one_device_or_are_refused_as_decided():
    results = run_grid([c for c in GRID if c.name in REPRESENTATIVE])
    assert [r.passed for r in results] == [True] * len(results)
    by_name = {r.case.name: r for r in results}
    big = by_name["dp2 tp2 pp2 zero1 (8 ranks)"]
    assert big.world_size == 8
    assert big.equivalence["max_rel_param_diff_per_step"] <= 1e-10
    assert by_name["dp3 tp1 pp2 zero1 (odd, 6 ranks)"].world_size == 6
    refused = by_name["dp2 pp2 zero2 (DeepSpeed refuses)"]
    assert refused.equivalence is None and "DeepSpeed" in refused.refusal
    table = grid_table(results)
    for column in ("config", "max |loss diff|", "max rel param diff", "result",
                   "first divergence"):
        assert column in table.splitlines()[0]
    assert table.count(" pass ") == 2 and "refused" in table


def test_a_missing_tied_embedding_all_reduce_is_located(monkeypatch):
    """Plant the bug the pipeline author warns about: the first and last stage's copies
    of the tied embedding never sum their gradients. The check must fail at step 0 on
    wte.weight, blaming a rank of the first or last stage."""
    monkeypatch.setattr(TiedEmbedding, "all_reduce_grads", lambda self: None)
    case = Case("broken", dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=2))
    result = run_case(case, steps=2)
    assert not result.passed
    first = result.equivalence["first_mismatch"]
    assert (first["step"], first["tensor"]) == (0, "wte.weight")
    assert first["rank"] is not None and first["rel_diff"] > 1e-6
    table = grid_table([result])
    assert "FAIL" in table and f"step 0, wte.weight, rank {first['rank']}" in table


def test_a_case_expected_to_be_refused_fails_if_it_runs():
    wrongly = Case("dp2 (claims refusal)", dict(dp=2), refused=True)
    result = run_case(wrongly, steps=1)
    assert result.refusal is None and not result.passed


@pytest.mark.parametrize("name", ["dp2 pp2 zero3 (DeepSpeed refuses)"])
def test_refusals_cost_no_training(name, monkeypatch):
    (case,) = [c for c in GRID if c.name == name]

    def no_training(*args, **kwargs):
        raise AssertionError("a refused layout must not train its reference")

    # (minipar.train is also a function's name: reach the module through importlib)
    monkeypatch.setattr(importlib.import_module("minipar.train.loop"), "reference_run",
                        no_training)
    assert run_case(case).passed


def test_a_v_with_data_parallelism_reduces_its_buckets_right():
    """ZB-V under DP with overlapped reduction: the hooks fire during each chunk's last W,
    and the wte that rank 0's two chunks share is reduced after the schedule."""
    (case,) = [c for c in GRID if c.name.startswith("dp2 pp2 zb-v zero1")]
    result = run_case(case)
    assert result.passed, result.equivalence


def test_cases_with_the_same_reference_train_it_once(monkeypatch):
    """pp2 gpipe and pp4 1f1b run the same 4 micro-batches of 2 on one device."""
    loop = importlib.import_module("minipar.train.loop")
    trained, real = [], loop.reference_run

    def counted(prepared, device=None):
        trained.append(prepared.config.schedule)
        return real(prepared, device)

    monkeypatch.setattr(loop, "reference_run", counted)
    cases = [c for c in GRID if c.name in ("pp2 gpipe", "pp4 1f1b")]
    results = run_grid(cases, steps=1)
    assert [r.passed for r in results] == [True, True]
    assert trained == ["gpipe"]  # the second case reused the first one's reference
