"""The H100 time model against MosaicML's MPT runs (llm-foundry's benchmarking README),
which it was not fitted on (minipar/plan/published_mpt.py: all 52 rows held out).

The figures below are the README's (copied from its "H100 80GB BF16" table, not from
the planner). Rows outside 10% are strict xfails, grouped by what the rows share, not by
their error; docs/planner.md says why each group is off.
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

# The groups outside 10%, by what they share
INTER_NODE_MICRO_2 = {("70b", 2048, 32), ("13b", 2048, 16), ("13b", 2048, 32),
                      ("13b", 2048, 64)}  # micro-batch 2 on 2 to 8 nodes
THIRTY_B_ON_ONE_NODE = {("30b", 8192, 8), ("30b", 4096, 8), ("30b", 2048, 8),
                        ("30b", 1024, 8)}  # 60 GB of its 80 in sharded states
THIRTEEN_B_MICRO_2_ONE_NODE = {("13b", 2048, 8)}
OUTSIDE = INTER_NODE_MICRO_2 | THIRTY_B_ON_ONE_NODE | THIRTEEN_B_MICRO_2_ONE_NODE


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
    for run in published_mpt.RUNS:  # every row: data parallel over its GPUs, ZeRO-3
        assert run.config.dp == run.gpus and run.config.zero == 3 and not run.fitted
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


def test_the_rows_are_within_ten_percent(compared):
    inside = {k: r for k, r in compared.items() if k not in OUTSIDE}
    assert len(inside) == 43  # (and 30b at seq 1,024 on 8 GPUs, +10.0%, in its group)
    off = {k: f"{r['error']:+.1%}" for k, r in inside.items()
           if abs(r["error"]) > published_h100.TOLERANCE}
    assert not off, off


def outside(group: set, reason: str):
    return pytest.param(group, marks=pytest.mark.xfail(
        strict=True, raises=AssertionError,
        reason=f"{reason} (docs/planner.md, the MPT rows)"))


@pytest.mark.parametrize("group", [
    outside(INTER_NODE_MICRO_2, "micro-batch 2 across nodes: the planner moves ZeRO-3's "
            "bytes at one NIC per GPU, which the published steps outrun"),
    outside(THIRTY_B_ON_ONE_NODE, "30B on 8 GPUs runs slower than on 16 or 32 where the "
            "planner's rate is flat"),
    outside(THIRTEEN_B_MICRO_2_ONE_NODE, "13B at micro-batch 2 without checkpointing: "
            "+21% on one node"),
], ids=["inter-node-micro-2", "30b-one-node", "13b-micro-2-one-node"])
def test_the_groups_outside_are_within_ten_percent(group, compared):
    errors = [compared[k]["error"] for k in group]
    assert all(abs(e) <= published_h100.TOLERANCE for e in errors), errors


def test_the_inter_node_rows_outrun_a_ring_at_one_nic_per_gpu():
    # the explanation of the first xfail: the planner's ZeRO-3 traffic alone, at one
    # 400 Gb/s NIC per GPU for the whole ring, takes longer than the published step did,
    # so the real job moved those bytes faster (NCCL runs one ring per NIC, so a group
    # of whole nodes crosses between nodes on all eight at once)
    h100 = presets.cluster("h100")
    for run, row in zip(published_mpt.RUNS, published_mpt.TABLE, strict=True):
        if key(row) not in INTER_NODE_MICRO_2:
            continue
        est = estimate(run.shape, run.config, h100.with_attention_kernel("triton"))
        published_step = run.flops(run.shape, run.config.global_batch_size) / (
            run.tflops * 1e12 * run.gpus)
        assert est.time["dp_comm_s"] > 1.5 * published_step, run.row


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

    assert main(["plan", "--compare-published", "--json", "-"]) == 0
    h100 = json.loads(capsys.readouterr().out)["h100"]
    assert published_mpt.MPT in h100["sources"]
    mpt = [r for r in h100["rows"] if r["source"] == published_mpt.MPT]
    assert len(mpt) == 52 and {r["attention_kernel"] for r in mpt} == {"triton"}
    assert main(["plan", "--compare-published"]) == 0
    out = capsys.readouterr().out
    assert "MPT, held out: 52 runs, 44 within 10%" in out
    assert "README, fitted: 5 runs" in out and "Llama 3, held out: 3 runs" in out
    assert "'triton' (the kernel their source names)" in out


def test_cli_attention_kernel_prices_every_row_the_mpt_ones_too(capsys):
    from minipar.cli import main

    def mpt_tflops(*flags):
        assert main(["plan", "--compare-published", "--json", "-", *flags]) == 0
        rows = json.loads(capsys.readouterr().out)["h100"]["rows"]
        return [r["tflops"] for r in rows if r["source"] == published_mpt.MPT]

    named, flash2 = mpt_tflops(), mpt_tflops("--attention-kernel", "flash2")
    # FlashAttention-2 is faster than the Triton kernel: every row rises but the four
    # whose step the inter-node traffic sets
    rose = [f > n * 1.001 for f, n in zip(flash2, named, strict=True)]
    assert all(f >= n * (1 - 1e-12) for f, n in zip(flash2, named, strict=True))
    assert sum(rose) == 52 - len(INTER_NODE_MICRO_2), rose


def test_cli_source_prints_only_the_chosen_sources(capsys):
    from minipar.cli import main

    assert main(["plan", "--compare-published", "--source", "mpt"]) == 0
    out = capsys.readouterr().out
    assert "MPT, held out: 52 runs" in out
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


def test_the_other_multi_node_rows_do_not_rest_on_the_inter_node_price():
    # priced at one NIC per GPU (the planner) or at all eight of a node's (NCCL's ring per
    # NIC), the multi-node rows outside the first group stay within 10%
    h100 = presets.cluster("h100").with_attention_kernel("triton")
    eight_nics = replace(h100, inter_node_bandwidth=8 * h100.inter_node_bandwidth)
    runs = [replace(run, attention_kernel=None)
            for run, row in zip(published_mpt.RUNS, published_mpt.TABLE, strict=True)
            if row[2] > 8 and key(row) not in INTER_NODE_MICRO_2]
    assert len(runs) == 11
    for cluster in (h100, eight_nics):
        rows = published_h100.compare(cluster, runs)
        assert all(abs(r["error"]) <= published_h100.TOLERANCE for r in rows), rows
