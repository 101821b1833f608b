"""The report (public contract, schema minipar.report/1) from a real single-device run."""

import json

import numpy as np
import pytest

from minipar.train import TrainConfig, train, validate_report
from minipar.train.report import Report, merge_step
from minipar.train.schema import load_schema

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def report():
    return train(TrainConfig(steps=3, seq_len=16, n_layer=2, d_model=32, n_head=4,
                             micro_batch_size=2, grad_accum_steps=2, precision="fp64"))


def test_report_validates_against_the_json_schema(report):
    data = json.loads(report.to_json())
    jsonschema.validate(data, load_schema())
    validate_report(data)  # the dependency-free validator agrees
    assert data["schema"] == "minipar.report/1"


def test_config_section_is_flat_and_complete(report):
    config = report.config
    for key in ("dp", "tp", "pp", "zero", "schedule", "micro_batch_size", "grad_accum_steps",
                "global_batch_size", "precision", "seed", "steps", "n_layer", "d_model"):
        assert key in config
    assert config["global_batch_size"] == 4
    assert all(not isinstance(v, dict) for v in config.values())


def test_one_entry_per_step_and_per_rank(report):
    assert [s["step"] for s in report.steps] == [0, 1, 2]
    assert report.world_size == 1 and len(report.ranks) == 1
    assert report.ranks[0]["coords"] == {"dp": 0, "pp": 0, "tp": 0}


def test_n_params_counts_the_full_model(report):
    assert report.n_params == sum(a.size for a in report.state_dict.values())


def test_params_memory_is_the_bytes_of_the_parameters(report):
    expected = sum(a.nbytes for a in report.state_dict.values())
    assert report.ranks[0]["memory"]["params"] == expected


def test_round_trip_through_json(report, tmp_path):
    path = tmp_path / "out.json"
    report.to_json(path)
    again = Report.from_json(path)
    assert again.to_dict() == report.to_dict()


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d.pop("ranks"), "ranks"),
    (lambda d: d.update(schema="minipar.report/0"), "schema"),
    (lambda d: d["ranks"][0]["memory"].pop("peak_total"), "peak_total"),
    (lambda d: d["steps"][0].update(loss="low"), "loss"),
])
def test_broken_reports_are_rejected_naming_the_field(report, mutate, where):
    data = json.loads(report.to_json())
    mutate(data)
    with pytest.raises(ValueError, match=where):
        validate_report(data)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, load_schema())


def test_losses_are_finite(report):
    assert np.all(np.isfinite(report.losses))


@pytest.fixture(scope="module")
def report_3d():
    return train(TrainConfig(steps=2, seq_len=8, n_layer=2, d_model=16, n_head=2,
                             micro_batch_size=1, grad_accum_steps=2, dp=2, tp=2, pp=2,
                             zero=1, gpus_per_node=1, precision="fp64", check=True))


def test_a_3d_report_validates_with_its_added_sections(report_3d):
    data = json.loads(report_3d.to_json())
    jsonschema.validate(data, load_schema())
    validate_report(data)
    assert {"pipeline", "layout", "warnings", "traffic", "step_end_s", "equivalence",
            "device"} <= set(data)
    assert data["device"]["flops"] == 400e12  # the default H100 profile
    assert data["pipeline"]["schedule"] == "1f1b"
    assert data["layout"]["tp_group_crosses_nodes"] is True and data["warnings"]
    assert len(data["traffic"]["matrix"]) == 8
    assert all(set(r["flops"]) == {"forward", "backward", "optimizer"} for r in data["ranks"])
    again = Report.from_dict(data)
    assert again.to_dict() == data


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d["pipeline"].pop("bubble_fraction"), "bubble_fraction"),
    (lambda d: d["layout"].update(tp_group_crosses_nodes="yes"), "tp_group_crosses_nodes"),
    (lambda d: d["traffic"].update(matrix=[[-1]]), "matrix"),
    (lambda d: d["ranks"][0]["flops"].pop("forward"), "forward"),
])
def test_broken_3d_sections_are_rejected(report_3d, mutate, where):
    data = json.loads(report_3d.to_json())
    mutate(data)
    with pytest.raises(ValueError, match=where):
        validate_report(data)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, load_schema())


def test_flops_per_rank_match_the_simulated_compute_time(report_3d):
    for r in report_3d.ranks:
        flops = sum(r["flops"].values())
        assert flops > 0
        rate = report_3d.device["flops"]
        assert flops / rate == pytest.approx(r["time"]["compute_s"], rel=1e-9)


def test_a_step_of_the_report_is_the_mean_loss_of_the_ranks():
    """Each rank's loss is a mean over equally many sequences of the global batch, so the
    global batch's loss is their mean; lr and grad_norm are the same on every rank."""
    records = [{"step": 3, "loss": loss, "lr": 1e-3, "grad_norm": 0.5}
               for loss in (1.0, 2.0, 4.5)]
    assert merge_step(records) == {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5}


def test_each_rank_reports_the_flops_it_recomputed():
    """recompute_flops: the forwards run again in backward, part of flops.forward;
    zero without recomputation."""
    plain = train(TrainConfig(steps=1, seq_len=16, n_layer=2, data="synthetic"))
    selective = train(TrainConfig(steps=1, seq_len=16, n_layer=2, data="synthetic",
                                  recompute_granularity="selective"))
    for report in (plain, selective):
        data = json.loads(report.to_json())
        jsonschema.validate(data, load_schema())
        validate_report(data)
    assert plain.ranks[0]["recompute_flops"] == 0
    extra = selective.ranks[0]["flops"]["forward"] - plain.ranks[0]["flops"]["forward"]
    assert selective.ranks[0]["recompute_flops"] == pytest.approx(extra, rel=1e-9)
    assert selective.ranks[0]["recompute_flops"] > 0


def test_exposed_communication_is_reported_beside_comm_time():
    """ranks[i].time.exposed_comm_s is the transfer time no compute hid (HTA's
    definition); with buckets reduced while backward runs, part of the transfers is
    overlapped_comm_s instead, and the same bytes move."""
    from minipar.demo import DEMO_PROFILE

    small = dict(steps=2, seq_len=16, n_layer=4, d_model=32, n_head=4, micro_batch_size=2,
                 dp=2, bucket_size_mb=0.005, data="synthetic")
    waited = train(TrainConfig(**small, overlap_grad_reduce=False), device=DEMO_PROFILE)
    hidden = train(TrainConfig(**small), device=DEMO_PROFILE)
    for before, after in zip(waited.ranks, hidden.ranks, strict=True):
        assert before["comm"] == after["comm"]
        # Waited at once, every transfer is exposed and is what the clock blocked for.
        assert before["time"]["overlapped_comm_s"] == 0
        assert before["time"]["exposed_comm_s"] == pytest.approx(before["time"]["comm_s"])
        # Overlapped, the transfers take as long but backward hides part of them.
        total = after["time"]["exposed_comm_s"] + after["time"]["overlapped_comm_s"]
        assert total == pytest.approx(before["time"]["exposed_comm_s"], rel=1e-9)
        assert after["time"]["exposed_comm_s"] < before["time"]["exposed_comm_s"]


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)])
def test_stage_times_are_one_micro_batch_s_f_b_w_per_virtual_stage(schedule, v):
    """pipeline.stage_times: the T_F, T_B, T_W of the papers' bubble formulas, measured
    on the simulated clock; I + W of a split backward costs the full backward's time."""
    settings = dict(pp=2, grad_accum_steps=4, steps=2, n_layer=4, seq_len=8, d_model=16,
                    n_head=2, micro_batch_size=2, virtual_stages=v)
    times = {}
    for name in ("1f1b", schedule):
        chunks = v if name == schedule else 1
        report = train(TrainConfig(**{**settings, "virtual_stages": chunks}, schedule=name))
        validate_report(report.to_dict())
        times[name] = report.pipeline["stage_times"]
    stages = times[schedule]
    assert [t["stage"] for t in stages] == list(range(2 * v))
    split = schedule != "1f1b"
    for t in stages:
        assert t["forward_s"] > 0 and t["backward_s"] > 0
        assert (t["backward_input_s"] is not None) == split
        if split:
            assert t["backward_s"] == pytest.approx(t["backward_input_s"]
                                                    + t["backward_weight_s"])
    if v == 1:  # the same stage, split or not: the same compute time
        for ours, plain in zip(stages, times["1f1b"], strict=True):
            assert ours["forward_s"] == pytest.approx(plain["forward_s"], rel=1e-12)
            assert ours["backward_s"] == pytest.approx(plain["backward_s"], rel=1e-12)


def test_an_offloaded_run_reports_its_tiers_and_transfers_in_the_schema():
    """ranks[i].memory_host / memory_nvme (the GPU ledger's keys) and ranks[i].transfers
    (four totals), as docs/design.md names them; `memory` stays the GPU's."""
    report = train(TrainConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, steps=1,
                               data="synthetic", dp=2, zero=3, offload_optimizer="nvme",
                               offload_param="cpu"))
    data = json.loads(json.dumps(report.to_dict()))
    validate_report(data)
    rank = data["ranks"][0]
    assert set(rank["memory_host"]) == set(rank["memory_nvme"]) == set(rank["memory"])
    assert rank["memory_nvme"]["optimizer"] > 0 and rank["memory"]["optimizer"] == 0
    assert rank["memory_host"]["params"] > 0 and rank["memory"]["params"] == 0
    assert all(rank["transfers"][f"{d}_bytes"] > 0
               for d in ("to_host", "to_device", "nvme_read", "nvme_write"))
    bad = json.loads(json.dumps(data))
    del bad["ranks"][0]["transfers"]["nvme_read_bytes"]
    with pytest.raises(ValueError, match="nvme_read_bytes"):
        validate_report(bad)
