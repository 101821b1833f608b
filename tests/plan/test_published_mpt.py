"""The H100 time model against MosaicML's MPT runs (llm-foundry's benchmarking README):
every second row fits the overlap contention, the others are held out
(minipar/plan/published_mpt.py).

The figures below are the README's (copied from its "H100 80GB BF16" table, not from
the planner). The row outside 10% is a strict xfail; docs/planner.md says why it is off.
Two groups of rows hold the two rules they brought in: the data-parallel ring across
nodes on all of a node's NICs (cluster.rails) and the compute lost to the collectives
it hides (timing.overlap_contention_seconds).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from minipar.plan import presets, published_h100, published_mpt
from minipar.plan.estimate import estimate

# (model, seq, GPUs, MFU %, Model TFLOP, MicroBatchSize, GradAccum, GlobalBatchSize,
#  Throughput (T/s), NumParams): a few rows of the README as it prints them
README_ROWS = [
    ("70b", 2048, 64, 42.57, 4.212583e14, 8, 4, 2048, 66523, 64862437376),
    ("13b", 32768, 8, 31.68, 3.134795e14, 1, 3, 24, 15812, 13011240960),
    ("7b", 2048, 8, 46.44, 4.595096e14, 6, 1, 48, 85144, 6658859008),
    ("1b", 65536, 8, 26.34, 2.606140e14, 1, 2, 16, 44050, 1445974016),
    ("760m", 512, 8, 40.42, 3.999190e14, 96, 2, 1536, 669998, 758111232),
]

# micro-batch 2 on 2 to 8 nodes: ZeRO-3's traffic is as long as a third of the step
INTER_NODE_MICRO_2 = {("70b", 2048, 32), ("13b", 2048, 16), ("13b", 2048, 32),
                      ("13b", 2048, 64)}
# the rows whose hidden ZeRO-3 traffic is largest against their compute
CONTENDED = INTER_NODE_MICRO_2 | {("13b", 2048, 8), ("30b", 4096, 8), ("30b", 2048, 8)}
# 30B at 8K tokens on 8 GPUs: 73 GiB of the 72 usable in the planner's count
OUTSIDE = {("30b", 8192, 8)}


def key(row) -> tuple[str, int, int]:
    return row[0], row[1], row[2]


@pytest.fixture(scope="module")
def compared() -> dict[tuple[str, int, int], dict]:
    rows = published_h100.compare(runs=published_mpt.RUNS)
    return {key(entry): row for entry, row in zip(published_mpt.TABLE, rows, strict=True)}


def test_the_rows_are_the_readmes():
    table = {key(row): row for row in published_mpt.TABLE}
    assert len(published_mpt.TABLE) == len(table) == 52
    for model, seq, gpus, mfu, model_tflop, micro, accum, batch, _, n_params in README_ROWS:
        _, _, _, micro_, batch_, _, tflops, n_params_ = table[model, seq, gpus]
        assert (micro_, batch_, n_params_) == (micro, batch, n_params)
        assert tflops * 1e12 == pytest.approx(model_tflop, rel=1e-6)
        assert micro * accum * gpus == batch
        # "Model TFLOP" is MFU against the H100's 989.5 dense BF16 TFLOP/s
        assert model_tflop / 989.5e12 == pytest.approx(mfu / 100, abs=1e-4)
    for i, run in enumerate(published_mpt.RUNS):  # data parallel over its GPUs, ZeRO-3
        assert run.config.dp == run.gpus and run.config.zero == 3
        assert run.fitted == (i % 2 == 1)  # every second row of the README's order
        assert run.config.global_batch_size % (run.config.micro_batch_size * run.gpus) == 0


def test_the_encoded_shapes_reproduce_the_readmes_numparams():
    # within 0.5% is the goal; the GPT-2 shape (biases, LayerNorm with bias, a learned
    # position table, tied embeddings) gives every row's count exactly
    for run, row in zip(published_mpt.RUNS, published_mpt.TABLE, strict=True):
        assert run.shape.n_params == pytest.approx(row[-1], rel=0.005), run.row
        assert run.shape.n_params == row[-1], run.row
    # the count grows with the sequence by one d_model-wide row per position: the
    # position table ALiBi would not have
    short, long = (published_mpt.mpt_shape("13b", s) for s in (2048, 32768))
    assert long.n_params - short.n_params == (32768 - 2048) * 5120


def test_the_flop_count_is_the_readmes():
    # the README's count times its measured tokens/s per GPU gives its Model TFLOP
    # (tokens/s is rounded to the token: 0.1% at most)
    for model, seq, gpus, _, model_tflop, *_, tokens_per_s, _ in README_ROWS:
        shape = published_mpt.mpt_shape(model, seq)
        per_sequence = published_mpt.mpt_flops(shape, 1)
        assert per_sequence * tokens_per_s / seq / gpus == pytest.approx(model_tflop,
                                                                          rel=1e-3)


def test_the_rows_are_within_ten_percent_fitted_and_held_out(compared):
    inside = {k: r for k, r in compared.items() if k not in OUTSIDE}
    assert len(inside) == 51
    off = {k: f"{r['error']:+.1%}" for k, r in inside.items()
           if abs(r["error"]) > published_h100.TOLERANCE}
    assert not off, off
    assert sum(not r["fitted"] for r in inside.values()) == 25


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="30B at 8K tokens on 8 GPUs runs 23% slower than the planner's "
                   "rate, which is flat from 8 to 32 GPUs; its memory is at the limit "
                   "(docs/planner.md, the MPT rows)")
def test_the_row_outside_is_within_ten_percent(compared):
    errors = [compared[k]["error"] for k in OUTSIDE]
    assert all(abs(e) <= published_h100.TOLERANCE for e in errors), errors


def test_the_inter_node_rows_outrun_a_ring_at_one_nic_per_gpu():
    # why the ring across nodes runs on all of a node's NICs (cluster.rails): at one
    # 400 Gb/s NIC per ring, the planner's ZeRO-3 traffic alone takes longer than the
    # published step did, so the real job moved those bytes faster; on the node's eight
    # NICs the rows are within 10%
    h100 = presets.cluster("h100").with_attention_kernel("triton")
    one_nic = replace(h100, nic_rails=False)
    runs = [run for run, row in zip(published_mpt.RUNS, published_mpt.TABLE, strict=True)
            if key(row) in INTER_NODE_MICRO_2]
    assert len(runs) == 4
    for run in runs:
        est = estimate(run.shape, run.config, one_nic)
        published_step = run.flops(run.shape, run.config.global_batch_size) / (
            run.tflops * 1e12 * run.gpus)
        assert est.time["dp_comm_s"] > 1.5 * published_step, run.row
    rails = published_h100.compare(h100, [replace(r, attention_kernel=None) for r in runs])
    assert all(abs(r["error"]) <= published_h100.TOLERANCE for r in rails), rails


def test_hidden_traffic_costs_compute_in_the_rows_where_it_is_largest(compared):
    # the overlap contention (timing.overlap_contention_seconds): without it the rows
    # whose hidden ZeRO-3 traffic is largest read 10-28% fast; with it, within 10%.
    # The multi-node rows elsewhere, whose traffic is small against their compute, stay
    # within 10% with or without it
    h100 = presets.cluster("h100").with_attention_kernel("triton")
    free = replace(h100, overlap_contention=0.0)
    chosen = [(run, row) for run, row in zip(published_mpt.RUNS, published_mpt.TABLE,
                                             strict=True) if key(row) in CONTENDED]
    assert len(chosen) == 7
    without = published_h100.compare(free, [replace(r, attention_kernel=None)
                                            for r, _ in chosen])
    assert all(r["error"] > published_h100.TOLERANCE for r in without), without
    assert all(abs(compared[key(row)]["error"]) <= published_h100.TOLERANCE
               for _, row in chosen)
    others = [replace(run, attention_kernel=None)
              for run, row in zip(published_mpt.RUNS, published_mpt.TABLE, strict=True)
              if row[2] > 8 and key(row) not in INTER_NODE_MICRO_2]
    assert len(others) == 11
    for cluster in (h100, free):
        rows = published_h100.compare(cluster, others)
        assert all(abs(r["error"]) <= published_h100.TOLERANCE for r in rows), rows


def test_the_triton_kernel_is_what_brings_the_long_rows_in():
    # priced as FlashAttention-2 itself, every row of 16K tokens or more reads over 15%
    # fast; with the Triton kernel's measured gap they are within 10%
    long = [(run, row) for run, row in zip(published_mpt.RUNS, published_mpt.TABLE,
                                           strict=True) if row[1] >= 16384
            and key(row) not in OUTSIDE]
    assert len(long) == 12
    runs = [run for run, _ in long]
    as_flash2 = published_h100.compare(runs=[replace(r, attention_kernel="flash2")
                                             for r in runs])
    as_triton = published_h100.compare(runs=runs)
    assert all(r["error"] > 0.15 for r in as_flash2), as_flash2
    assert all(abs(r["error"]) <= published_h100.TOLERANCE for r in as_triton)


def test_cli_prints_the_mpt_rows_and_a_summary_per_source(capsys):
    from minipar.cli import main

    sources = ["--source", "mpt", "--source", "readme", "--source", "llama3"]
    assert main(["plan", "--compare-published", "--json", "-", *sources]) == 0
    h100 = json.loads(capsys.readouterr().out)["h100"]
    assert published_mpt.MPT in h100["sources"]
    mpt = [r for r in h100["rows"] if r["source"] == published_mpt.MPT]
    assert len(mpt) == 52 and {r["attention_kernel"] for r in mpt} == {"triton"}
    assert main(["plan", "--compare-published", *sources]) == 0
    out = capsys.readouterr().out
    assert "MPT, fitted: 26 runs, 26 within 10%" in out
    assert "MPT, held out: 26 runs, 25 within 10%" in out
    assert "README, fitted: 5 runs" in out and "Llama 3, held out: 3 runs" in out
    assert "'triton' (the kernel their source names)" in out


def test_cli_attention_kernel_prices_every_row_the_mpt_ones_too(capsys):
    from minipar.cli import main

    def mpt_tflops(*flags):
        assert main(["plan", "--compare-published", "--json", "-", "--source", "mpt",
                     *flags]) == 0
        rows = json.loads(capsys.readouterr().out)["h100"]["rows"]
        return [r["tflops"] for r in rows if r["source"] == published_mpt.MPT]

    named, flash2 = mpt_tflops(), mpt_tflops("--attention-kernel", "flash2")
    # FlashAttention-2 is faster than the Triton kernel: every row rises
    assert all(f > n * 1.001 for f, n in zip(flash2, named, strict=True))


def test_cli_source_prints_only_the_chosen_sources(capsys):
    from minipar.cli import main

    assert main(["plan", "--compare-published", "--source", "mpt"]) == 0
    out = capsys.readouterr().out
    assert "MPT, held out: 26 runs" in out and "MPT, fitted: 26 runs" in out
    assert "README," not in out and "Llama 3," not in out and "run_table_1.sh" not in out
    assert main(["plan", "--compare-published", "--source", "table1", "--source",
                 "llama3", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["rows"]) == 10
    assert {r["label"] for r in report["h100"]["rows"]} == {"Llama 3"}
    assert report["h100"]["sources"] == [published_h100.LLAMA3]


def test_cli_source_without_compare_published_is_one_line(capsys):
    from minipar.cli import main

    assert main(["plan", "--source", "mpt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compare-published" in err
