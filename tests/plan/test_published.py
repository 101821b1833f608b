"""The time model against a real cluster: Narayanan et al. 2021, Table 1.

The expected values are the paper's (copied here from the table, not from the planner):
every row's predicted TFLOP/s per GPU within 10%, and throughput rising with model size
from 18.4B up, as it does on Selene. The uniform model (one efficiency for every FLOP)
misses both, which is why the roofline exists.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from minipar.cli import main
from minipar.errors import ConfigError
from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.published import TABLE_1, compare, paper_flops

# (params, heads, h, layers, t, p, GPUs, global batch, achieved TFLOP/s per GPU)
PUBLISHED = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
TARGET = 0.10


@pytest.fixture(scope="module")
def predicted() -> dict[str, float]:
    return {row["model"]: row["tflops"] for row in compare()}


def test_the_rows_are_the_papers():
    assert [(r.name, r.heads, r.hidden, r.layers, r.tp, r.pp, r.gpus, r.global_batch,
             r.tflops) for r in TABLE_1] == PUBLISHED
    for run, (name, *_) in zip(TABLE_1, PUBLISHED, strict=True):
        # the parameter count in the row's name (the paper's 12 l h^2 (1 + 13/12h +
        # (V + s)/12lh); the labels round it: 1.65B is "1.7B", 3.56B "3.6B")
        billions = float(name.rstrip("B"))
        assert run.shape.n_params / 1e9 == pytest.approx(billions, rel=0.03)
        assert run.config.world_size == run.gpus


def test_eq3_is_the_model_flops_with_the_layers_counted_four_times():
    # 96 B s l h^2 (1 + s/6h + V/16lh): the layers' forward 4 times (recomputation), the
    # logits' 3 times; the planner's model FLOPs count each 3 times
    run = TABLE_1[-1]
    shape, batch = run.shape, run.global_batch
    logits = 3 * 2 * shape.seq_len * shape.d_model * shape.vocab_size * batch
    layers = shape.model_flops_per_sequence() * batch - logits
    assert paper_flops(shape, batch) == pytest.approx(4 / 3 * layers + logits, rel=1e-12)
    # the paper's headline: the 1T model at 502 petaFLOP/s on 3072 GPUs = 163 per GPU
    assert 163 * 3072 / 1000 == pytest.approx(502, rel=0.005)


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_every_row_within_ten_percent_of_the_published_throughput(row, predicted):
    name, published = row[0], row[-1]
    assert predicted[name] == pytest.approx(published, rel=TARGET), (
        f"{name}: predicted {predicted[name]:.1f}, published {published}")


def test_throughput_rises_with_model_size_from_18b_up(predicted):
    rows = PUBLISHED[3:]
    sizes = [float(r[0].rstrip("B")) for r in rows]
    ours = [predicted[r[0]] for r in rows]
    # Spearman rank correlation of size and predicted throughput (the published one is
    # 0.98 with its tie): strongly positive
    order = sorted(range(len(ours)), key=ours.__getitem__)
    ranks = [order.index(i) for i in range(len(ours))]
    n = len(ranks)
    rho = 1 - 6 * sum((i - r) ** 2 for i, r in enumerate(ranks)) / (n * (n * n - 1))
    assert rho >= 0.8
    # and the least-squares slope of TFLOP/s against log(size) is within a factor of two
    # of the published slope (which is positive: 135 at 18.4B, 163 at 1T)
    def slope(values):
        xs = [math.log(s) for s in sizes]
        mx, my = sum(xs) / n, sum(values) / n
        return (sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True))
                / sum((x - mx) ** 2 for x in xs))

    published_slope = slope([r[-1] for r in rows])
    assert published_slope > 0
    assert 0.5 * published_slope < slope(ours) < 2 * published_slope


def test_the_uniform_model_misses_the_target():
    # One efficiency (60% of peak) for every FLOP: the small models come out far too fast
    uniform = compare(presets.cluster("a100").uniform(0.6))
    errors = {row["model"]: row["error"] for row in uniform}
    assert errors["1.7B"] > TARGET
    assert errors["1.7B"] > errors["1008.0B"]  # the wrong trend


def test_cli_prints_published_vs_predicted_and_the_assumptions(capsys):
    # (Table 1's rows only: the whole table is the README's command, run by test_docs)
    assert main(["plan", "--compare-published", "--source", "table1"]) == 0
    out = capsys.readouterr().out
    for name, *_, published in PUBLISHED:
        assert any(line.split()[:1] == [name] and f" {published} " in line
                   for line in out.splitlines()), name
    assert "assumptions:" in out and "run_table_1.sh" in out
    assert "error" in out.splitlines()[2]


def test_cli_compare_published_refuses_a_layout(capsys):
    assert main(["plan", "--compare-published", "--model", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compare-published" in err


# ------------------------------------------------------------------ H100 (published_h100.py)
def readme_rows(cluster=None, runs=None) -> list[dict]:
    from minipar.plan import published_h100

    runs = published_h100.RUNS if runs is None else runs
    return [r for r in published_h100.compare(cluster, runs)
            if r["source"] == published_h100.README]


def test_h100_runs_of_megatrons_readme_within_ten_percent_fitted_and_held_out():
    from minipar.plan import published_h100

    rows = readme_rows()
    assert len(rows) == 9 and sum(r["fitted"] for r in rows) == 5
    for r in rows:
        assert abs(r["error"]) <= published_h100.TOLERANCE, r


def test_the_readme_rows_of_a_wide_vocabulary_slice_pay_megatrons_unfused_loss():
    # the README rows run Megatron-Core r0.8's default loss, op by op in fp32
    # (kernels.cross_entropy_bytes: 6.5x the fused kernel's bytes per logit); priced as
    # one fused kernel, the rows of tp 1, 2 and 4, whose GPUs each hold 131,072 / tp of
    # the vocabulary, read 11-15% fast, and those of tp 8 move by under 2 points
    from minipar.plan import published_h100

    runs = [r for r in published_h100.RUNS if r.source == published_h100.README]
    assert not any(r.config.cross_entropy_loss_fusion for r in runs)
    fused = readme_rows(runs=[replace(r, config=r.config.replace(
        cross_entropy_loss_fusion=True)) for r in runs])
    unfused = readme_rows(runs=runs)
    for before, after in zip(fused, unfused, strict=True):
        if "tp 8" in after["row"]:
            assert abs(before["error"] - after["error"]) < 0.02, after
        else:
            assert before["error"] > published_h100.TOLERANCE, before


def test_llama3_table_4_is_held_out_and_its_8k_rows_within_twenty_percent():
    # the 10% goal is not met on these (docs/planner.md says what is left: Meta's stack
    # beside Megatron-Core's, which reaches the planner's rate at the same h); this pins
    # what the planner predicts today for the two 8K-sequence rows (+14%, +17%)
    from minipar.plan import published_h100

    rows = [r for r in published_h100.compare() if r["source"] == published_h100.LLAMA3]
    assert [r["published"] for r in rows] == [430, 400, 380]
    assert not any(r["fitted"] for r in rows)
    assert all(abs(r["error"]) <= 0.20 for r in rows[:2]), rows


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="the 8K rows are 14-17% fast where Megatron-Core's README runs "
                   "of the same h are within 1% (docs/planner.md, the Llama 3 rows)")
def test_llama3_8k_rows_within_ten_percent():
    from minipar.plan import published_h100

    rows = [r for r in published_h100.compare() if r["source"] == published_h100.LLAMA3]
    assert all(abs(r["error"]) <= published_h100.TOLERANCE for r in rows[:2]), rows


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="by the paper's full-attention count the row reads +59%; counted "
                   "causal it reads +14%, as the 8K rows (docs/planner.md, the Llama 3 "
                   "rows)")
def test_llama3_long_context_row_within_twenty_percent():
    from minipar.plan import published_h100

    row = [r for r in published_h100.compare() if r["source"] == published_h100.LLAMA3][2]
    assert "seq 131,072" in row["row"]
    assert abs(row["error"]) <= 0.20, row


def test_llama3_rows_read_alike_when_attention_is_counted_causal():
    # Table 4 cites PaLM's MFU, whose 12 L H Q T counts attention full; at 131K tokens
    # that term is 57% of the count, and the row reads +59% against +15-17% at 8K.
    # Counted causal (half of it: what the kernel computes, and today's Megatron-LM
    # count), the paper's 131K step is 10.9 s, not 15.3 s, and the three rows read
    # within 3 points of each other: the 131K row holds no miss of its own
    from minipar.plan import published_h100

    rows = [r for r in published_h100.compare() if r["source"] == published_h100.LLAMA3]
    full = [r["error"] for r in rows]
    causal = [r["other_count"]["error"] for r in rows]
    assert full[2] > 0.5 and max(full[:2]) < 0.2
    assert max(causal) - min(causal) < 0.03 and 0.10 < min(causal), causal
    run = [r for r in published_h100.RUNS if r.source == published_h100.LLAMA3][2]
    step = published_h100.palm_causal_flops(run.shape, run.config.global_batch_size) / (
        run.gpus * run.tflops * 1e12)
    assert step == pytest.approx(10.94, abs=0.01)


def test_llama3_8k_to_16k_follows_the_papers_interleaving_depth():
    # 8K -> 16K GPUs halves the micro-batches per step (32 -> 16 a DP rank): the paper's
    # 430 -> 400 is V = 8's bubble (PP-1)/(V M) (section 3.3.2; V = 2 would make the
    # planner's ratio 0.83); the planner's ratio within 3% of the paper's
    from minipar.plan import published_h100

    rows = [r for r in published_h100.compare() if r["source"] == published_h100.LLAMA3]
    eight, sixteen = rows[0], rows[1]
    assert [eight["gpus"], sixteen["gpus"]] == [8192, 16384]
    published = sixteen["published"] / eight["published"]
    predicted = sixteen["tflops"] / eight["tflops"]
    assert abs(predicted / published - 1) <= 0.03, (predicted, published)


def test_automodels_fsdp2_row_is_its_tables_own_arithmetic():
    # the table's three figures agree under AutoModel's count (llama3_flops: causal
    # attention): 389 TFLOP/s a GPU = 866.77 tokens/s a GPU = 128 x 8192 tokens in 18.90 s
    from minipar.plan import published_h100

    run = [r for r in published_h100.RUNS if r.source == published_h100.AUTOMODEL][0]
    tokens = run.config.global_batch_size * run.shape.seq_len
    assert run.gpus == 64 and (run.config.dp, run.config.cp, run.config.zero) == (32, 2, 3)
    assert tokens / 18.90 / run.gpus == pytest.approx(866.77, rel=5e-4)  # (18.90 rounded)
    flops = published_h100.automodel_flops(run.shape, run.config.global_batch_size)
    assert flops / (18.90 * run.gpus) / 1e12 == pytest.approx(run.tflops, rel=2e-3)
    # a full-attention count would put the same step at 7% more TFLOP/s
    full = published_h100.megatron_flops(run.shape, run.config.global_batch_size)
    assert 1.06 < full / flops < 1.08


def test_automodels_fsdp2_run_with_context_parallelism_within_ten_percent():
    # a third stack, held out: PyTorch FSDP2 over 32 ranks x CP 2, every block
    # recomputed, gradients reduce-scattered in fp32 every micro-batch. Without the
    # recipe's activation checkpointing the planner's step is 17% fast, and the layout
    # does not fit the GPU
    from minipar.plan import published_h100

    runs = [r for r in published_h100.RUNS if r.source == published_h100.AUTOMODEL]
    [row] = published_h100.compare(runs=runs)
    assert not row["fitted"] and row["fits"]
    assert abs(row["error"]) <= published_h100.TOLERANCE, row
    [bare] = published_h100.compare(runs=[replace(runs[0], config=runs[0].config.replace(
        recompute_granularity=None))])
    assert bare["error"] > published_h100.TOLERANCE and not bare["fits"], bare


def test_the_readme_rows_stay_within_ten_percent_whichever_measured_kernel_runs():
    # the kernel is an assumption (neither source names it): the README fit must not
    # rest on the choice, so each measured H100 kernel keeps the README rows in 10%
    from minipar.plan import published_h100

    # (under FlashAttention-2's, the slowest measured, all but 1.7B: -13.9%)
    h100 = presets.cluster("h100")
    for name in ("flash2", "cudnn", "flash3"):
        readme = readme_rows(h100.with_attention_kernel(name))
        if name == "flash2":
            readme = [r for r in readme if not r["row"].startswith("1.7B")]
        assert all(abs(r["error"]) <= published_h100.TOLERANCE for r in readme), (name,
                                                                                  readme)


def test_slower_attention_moves_the_long_context_row_most():
    # at 131K tokens attention is 57% of the count, at 8K 8%: the measured kernels'
    # spread moves the CP 16 row several times more than the 8K ones
    from minipar.plan import published_h100

    h100 = presets.cluster("h100")
    llama = {name: [r["tflops"] for r in published_h100.compare(
        h100.with_attention_kernel(name)) if r["source"] == published_h100.LLAMA3]
        for name in ("flash2", "flash3")}
    moved = [1 - slow / fast for slow, fast in zip(llama["flash2"], llama["flash3"],
                                                     strict=True)]
    assert moved[2] > 3 * max(moved[:2]), moved


def test_the_h100_runs_micro_batch_rule():
    # micro-batch 2 where it fits the GPU and leaves m >= pp, else 1: one rule, every row
    from minipar.plan import published_h100

    h100 = presets.cluster("h100")
    for run in published_h100.RUNS:
        if run.source == published_h100.AUTOMODEL:  # (its micro-batch is published)
            continue
        try:
            two = run.config.replace(micro_batch_size=2,
                                     global_batch_size=run.config.global_batch_size)
            fits = two.micro_batches >= two.pp and estimate(run.shape, two, h100).fits
        except ConfigError:  # (the interleaved schedule's multiple of pp)
            fits = False
        assert run.config.micro_batch_size == (2 if fits else 1), run.row


def test_tp_comm_overlap_hides_the_sequence_parallel_collectives_behind_gemms():
    shape, h100 = presets.model("llama2-70b"), presets.cluster("h100")
    config = ParallelConfig(dp=8, tp=8, pp=4, zero=1, sequence_parallel=True,
                            micro_batch_size=1, global_batch_size=1024, flash_attention=True)
    plain, overlapped = (estimate(shape, config.replace(tp_comm_overlap=on), h100)
                         for on in (False, True))
    tp = plain.comm_time_by_group()["tp"]
    assert overlapped.step_time < plain.step_time
    # at most all of it, on the pipeline's critical path of m + p - 1 micro-batch slots
    m, pp = config.micro_batches, config.pp
    assert plain.step_time - overlapped.step_time <= tp * (m + pp - 1) / m * 1.001
    assert overlapped.time["exposed_comm_s"] < plain.time["exposed_comm_s"] - 0.5 * tp
    with pytest.raises(ConfigError):
        config.replace(sequence_parallel=False, tp_comm_overlap=True)


def test_overlap_param_gather_hides_the_distributed_optimizers_all_gather():
    shape, h100 = presets.model("llama2-13b"), presets.cluster("h100")
    config = ParallelConfig(dp=32, tp=2, zero=1, sequence_parallel=True, micro_batch_size=1,
                            global_batch_size=1024, flash_attention=True, bucket_size_mb=80)
    plain, overlapped = (estimate(shape, config.replace(overlap_param_gather=on), h100)
                         for on in (False, True))
    assert overlapped.time["tail_s"] < plain.time["tail_s"]
    with pytest.raises(ConfigError):
        config.replace(zero=2, overlap_param_gather=True)


def test_a_time_says_whether_published_runs_calibrate_its_profile():
    shape, config = presets.model("gpt2"), ParallelConfig(dp=8, micro_batch_size=8,
                                                          global_batch_size=512)
    for name in ("h100", "a100", "emulated"):
        text = estimate(shape, config, presets.cluster(name)).table()
        assert "calibrated on" in text
    text = estimate(shape, config, presets.cluster("h100").uniform(0.5)).table()
    assert "uncalibrated" in text


def test_plan_unties_the_embeddings_as_train_does(capsys):
    from minipar.plan.cli import main

    assert main(["plan", "--model", "gpt2", "--dp", "8", "--no-tie-embeddings",
                 "--json"]) == 0
    untied = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "gpt2", "--dp", "8", "--json"]) == 0
    tied = json.loads(capsys.readouterr().out)
    assert untied["model"]["tie_embeddings"] is False and tied["model"]["tie_embeddings"]
    assert untied["model"]["n_params"] - tied["model"]["n_params"] == 50257 * 768
