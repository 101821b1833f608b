"""The single-device training loop: it learns, it is deterministic, its ledger is honest."""

import math

import numpy as np
import pytest

from minipar.nn import GPT
from minipar.train import TrainConfig, train
from minipar.train.config import gpt_config

SMALL = dict(seq_len=16, n_layer=2, d_model=32, n_head=4, micro_batch_size=4)


def test_loss_starts_near_ln_vocab_and_falls_on_the_corpus():
    report = train(TrainConfig(steps=30, lr=3e-3, warmup_steps=3, **SMALL))
    vocab = report.config["vocab_size"]
    assert abs(report.losses[0] - math.log(vocab)) < 0.3
    assert np.mean(report.losses[-5:]) < report.losses[0] - 0.7


def test_same_seed_gives_bit_identical_losses():
    config = TrainConfig(steps=4, precision="fp64", **SMALL)
    assert train(config).losses == train(config).losses


def test_different_seed_gives_different_losses():
    config = TrainConfig(steps=2, precision="fp64", **SMALL)
    assert train(config).losses != train(config.replace(seed=1)).losses


def test_accumulation_matches_one_big_micro_batch_in_fp64():
    """Two micro-batches of 2 accumulate to the gradient of one batch of 4."""
    big = train(TrainConfig(steps=3, precision="fp64", **{**SMALL, "micro_batch_size": 4}))
    accumulated = train(TrainConfig(steps=3, precision="fp64", grad_accum_steps=2,
                                    **{**SMALL, "micro_batch_size": 2}))
    np.testing.assert_allclose(accumulated.losses, big.losses, rtol=1e-12)
    for name, value in big.state_dict.items():
        np.testing.assert_allclose(accumulated.state_dict[name], value, rtol=1e-9, atol=1e-12)


def test_final_weights_differ_from_initial_weights():
    config = TrainConfig(steps=2, precision="fp64", **SMALL)
    report = train(config)
    initial = GPT(gpt_config(config, report.config["vocab_size"]), seed=0,
                  precision="fp64").state_dict()
    assert set(initial) == set(report.state_dict)
    assert any(not np.array_equal(initial[k], report.state_dict[k]) for k in initial)


def test_memory_categories_are_measured():
    report = train(TrainConfig(steps=2, **SMALL))
    memory = report.ranks[0]["memory"]
    params = sum(a.nbytes for a in report.state_dict.values())
    assert memory["params"] == params          # fp32: 4 bytes per parameter
    assert memory["grads"] == params           # one gradient per parameter, same dtype
    assert memory["optimizer"] == 2 * params   # AdamW m and v in fp32
    assert memory["activations"] > 0
    assert memory["peak_total"] <= sum(memory[k] for k in
                                       ("params", "grads", "optimizer", "activations", "buffers"))
    assert memory["peak_total"] >= memory["params"] + memory["optimizer"]


def test_bf16_mixed_holds_two_two_twelve_bytes_per_parameter():
    report = train(TrainConfig(steps=1, precision="bf16-mixed", **SMALL))
    memory, n = report.ranks[0]["memory"], report.n_params
    assert (memory["params"], memory["grads"], memory["optimizer"]) == (2 * n, 2 * n, 12 * n)


def test_activation_checkpointing_lowers_the_activation_peak_and_adds_flops():
    plain = train(TrainConfig(steps=1, **SMALL))
    ckpt = train(TrainConfig(steps=1, recompute_granularity="full", **SMALL))
    assert ckpt.ranks[0]["memory"]["activations"] < plain.ranks[0]["memory"]["activations"]
    assert ckpt.ranks[0]["time"]["compute_s"] > plain.ranks[0]["time"]["compute_s"]
    np.testing.assert_allclose(ckpt.losses, plain.losses, rtol=1e-5)


def test_a_run_shorter_than_the_warmup_warms_up_over_its_steps():
    report = train(TrainConfig(steps=1, warmup_steps=5, **SMALL))
    assert report.steps[0]["lr"] == pytest.approx(report.config["lr"])


def test_data_parallel_ranks_report_their_mesh_coordinates():
    report = train(TrainConfig(steps=2, dp=4, gpus_per_node=2, precision="fp64", **SMALL))
    assert report.world_size == 4 and len(report.ranks) == 4
    assert [r["coords"] for r in report.ranks] == [{"dp": i, "pp": 0, "tp": 0}
                                                   for i in range(4)]
    assert [r["node"] for r in report.ranks] == [0, 0, 1, 1]
    assert report.config["global_batch_size"] == 4 * SMALL["micro_batch_size"]


def test_data_parallel_trains_like_one_device_with_the_same_global_batch():
    """dp=4 x micro 2 sees the same 8 sequences per step as one device with 4 micro-
    batches of 2: same losses and weights up to fp64 rounding."""
    config = TrainConfig(steps=3, precision="fp64", **{**SMALL, "micro_batch_size": 2})
    parallel = train(config.replace(dp=4))
    single = train(config.replace(grad_accum_steps=4))
    np.testing.assert_allclose(parallel.losses, single.losses, rtol=1e-12)
    for name, value in single.state_dict.items():
        np.testing.assert_allclose(parallel.state_dict[name], value, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ 3D: dp x tp x pp
LAYOUT_3D = {**SMALL, "micro_batch_size": 2, "n_layer": 4, "dp": 2, "tp": 2, "pp": 2,
             "zero": 1, "grad_accum_steps": 2}


def test_3d_parallel_ranks_report_mesh_coordinates_nodes_and_groups():
    report = train(TrainConfig(steps=1, gpus_per_node=4, **LAYOUT_3D))
    # rank = (dp * pp + pp_index) * tp + tp_index: tp fastest (Megatron, picotron)
    expected = [{"dp": d, "pp": p, "tp": t} for d in range(2) for p in range(2)
                for t in range(2)]
    assert [r["coords"] for r in report.ranks] == expected
    assert [r["node"] for r in report.ranks] == [0, 0, 0, 0, 1, 1, 1, 1]
    groups = report.layout["groups"]
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert report.layout["nodes"] == 2 and not report.layout["tp_group_crosses_nodes"]


def test_3d_traffic_matrix_adds_up_to_each_ranks_sent_and_received_bytes():
    report = train(TrainConfig(steps=1, **LAYOUT_3D))
    matrix = np.array(report.traffic["matrix"])
    assert matrix.shape == (8, 8) and np.all(np.diag(matrix) == 0)
    np.testing.assert_array_equal(matrix.sum(axis=1), report.sent_bytes())
    np.testing.assert_array_equal(matrix.sum(axis=0),
                                  [r["comm"]["recv_bytes"] for r in report.ranks])
    for kind, part in report.traffic["by_group"].items():
        np.testing.assert_array_equal(np.array(part).sum(axis=1), report.sent_bytes(kind))
    # TP traffic stays inside TP groups, pipeline traffic inside pipeline groups
    tp = np.array(report.traffic["by_group"]["tp"])
    assert all(tp[i, j] == 0 for i in range(8) for j in range(8) if i // 2 != j // 2)


def test_the_pipeline_section_reports_the_schedule_and_the_measured_bubble():
    report = train(TrainConfig(steps=1, **{**LAYOUT_3D, "grad_accum_steps": 4}))
    pipeline = report.pipeline
    assert pipeline["schedule"] == "1f1b" and pipeline["micro_batches"] == 4
    assert pipeline["layers_per_stage"] == [2, 2]
    assert pipeline["uniform_bubble_fraction"] == pytest.approx(1 / 5)
    idle = sum(r["time"]["idle_s"] for r in report.ranks)
    assert 0 < pipeline["bubble_fraction"] < 1 and idle > 0
    assert train(TrainConfig(steps=1, **SMALL)).pipeline is None


def test_step_windows_cover_the_run_on_the_simulated_clock():
    report = train(TrainConfig(steps=3, **LAYOUT_3D))
    ends = report.step_end_s
    assert len(ends) == 3 and ends == sorted(ends) and ends[0] > 0
    assert report.step_window(0) == (0.0, ends[0])
    assert report.step_window(-1) == (ends[1], ends[2])
    longest = max(sum(r["time"][k] for k in ("compute_s", "comm_s", "idle_s"))
                  for r in report.ranks)
    assert ends[-1] == pytest.approx(longest)


@pytest.mark.parametrize("settings", [
    LAYOUT_3D,
    {**SMALL, "tp": 2, "pp": 2, "sequence_parallel": True, "schedule": "gpipe",
     "grad_accum_steps": 2, "recompute_granularity": "full"},
    {**SMALL, "dp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2,
     "grad_accum_steps": 2, "n_layer": 4, "tie_embeddings": False},
])
def test_3d_layouts_train_like_one_device_with_the_same_global_batch(settings):
    config = TrainConfig(steps=3, precision="fp64", **settings)
    parallel = train(config)
    single = train(config.replace(dp=1, tp=1, pp=1, zero=0, sequence_parallel=False,
                                  schedule="1f1b", virtual_stages=1,
                                  grad_accum_steps=config.grad_accum_steps * config.dp,
                                  global_batch_size=config.global_batch_size))
    np.testing.assert_allclose(parallel.losses, single.losses, rtol=1e-12)
    assert set(parallel.state_dict) == set(single.state_dict)
    for name, value in single.state_dict.items():
        np.testing.assert_allclose(parallel.state_dict[name], value, rtol=1e-9, atol=1e-12)


def test_3d_checkpoints_resume_under_another_layout(tmp_path):
    # (the first run stops after the 2 warm-up steps: the schedule up to there does not
    # depend on the total number of steps)
    config = TrainConfig(steps=3, warmup_steps=2, precision="fp64", **LAYOUT_3D)
    full = train(config)
    train(config.replace(steps=2), save_dir=tmp_path)
    other = config.replace(dp=1, tp=2, pp=1, zero=0, grad_accum_steps=4)
    resumed = train(other, resume_from=tmp_path)
    np.testing.assert_allclose(resumed.losses, full.losses[2:], rtol=1e-12)
    for name, value in full.state_dict.items():
        np.testing.assert_allclose(resumed.state_dict[name], value, rtol=1e-9, atol=1e-13)


def test_a_traced_run_writes_one_nested_trace_per_rank_and_changes_no_number(tmp_path):
    from minipar.distributed import read_traces

    config = TrainConfig(steps=2, dp=2, pp=2, grad_accum_steps=2, precision="fp64", **SMALL)
    traced, plain = train(config, trace=tmp_path), train(config)
    assert traced.losses == plain.losses and traced.ranks == plain.ranks
    traces = read_traces(tmp_path)
    assert len(traces) == 4
    for trace, rank in zip(traces, traced.ranks, strict=True):
        events = trace["traceEvents"]
        steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
        assert [e["name"] for e in steps] == ["ProfilerStep#0", "ProfilerStep#1"]
        assert trace["minipar"]["coords"] == rank["coords"]
        by_thread = {}
        for e in events:
            if e.get("cat") == "kernel":
                by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        for spans in by_thread.values():  # slices on one thread never overlap
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    ends = [s["ts"] + s["dur"] for s in steps]
    assert ends[-1] == pytest.approx(traced.step_end_s[-1] * 1e6)


# ------------------------------------------------------------------ read once, checked once
def counting(monkeypatch, module, name: str) -> list:
    """Replace module.name by a wrapper that records each call; returns the record."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_a_checked_run_reads_its_data_and_checks_its_layout_once(monkeypatch):
    """The --check reference trains from the stream `train` read, after the one layout
    check of the run (whose warnings the report carries)."""
    import minipar
    from minipar.train import data, mixes

    # (counted inside the two functions, whoever calls them)
    streams = counting(monkeypatch, data, "corpus_stream")  # make_stream's read
    checks = counting(monkeypatch, mixes, "tp_groups_across_nodes")  # check_layout's
    config = TrainConfig(steps=1, pp=2, grad_accum_steps=1, precision="fp64", check=True,
                         **SMALL)
    report = train(config)
    assert report.equivalence["passed"] and len(report.warnings) == 1  # "never fills"
    assert (len(streams), len(checks)) == (1, 1)
    minipar.train(config)  # the public entry point: the memory estimate reuses them too
    assert (len(streams), len(checks)) == (2, 2)


def test_a_resumed_checked_run_loads_its_checkpoint_once(tmp_path, monkeypatch):
    from minipar.train import checkpoint

    config = TrainConfig(steps=2, dp=2, zero=1, precision="fp64", **SMALL)
    train(config.replace(steps=1), save_dir=tmp_path)
    loads = counting(monkeypatch, checkpoint, "load_checkpoint")
    resumed = train(config.replace(check=True), resume_from=tmp_path)
    assert len(loads) == 1
    assert resumed.equivalence["passed"] and [s["step"] for s in resumed.steps] == [1]
    assert resumed.reference.losses == pytest.approx(resumed.losses, rel=1e-10)
