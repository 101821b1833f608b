"""The H100 time model against NVIDIA's DGX Cloud Benchmarking runs of NeMo (BF16, DGX
H100): 32 runs of six models in release v24.11.1 and 56 in four later releases, none
fitted (minipar/plan/published_dgxc.py).

The figures below are the recipes' (copied from each README's "Expected Performance"
table and "Notes", not from the planner). The step time is what was measured; the MFU
column is derived from it by the README's own formula, so agreeing with it checks the
transcription.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from minipar.plan import published_dgxc, published_h100
from minipar.plan.estimate import estimate

# each table's header (later releases: its configuration table): (TP, PP, CP, VP, MBS,
# GA); three differ from what ran, as the module docstring says: GPT-3 in v25.02 ran
# the yaml's VP 6 under a header of 12, v25.04's 340B table says VP "NA" where
# launch.sh passes 12, and v25.05.01's 405B row says GA 32 where its GBS 256 over DP 4
# is 64
HEADERS = {"llama3.1-8b": (1, 1, 2, None, 1, 32), "llama3.1-70b": (4, 4, 2, 5, 1, 64),
           "llama3.1-405b": (8, 9, 2, 7, 1, 63), "nemotron4-15b": (4, 1, None, None, 4, 4),
           "nemotron4-340b": (8, 8, None, 12, 1, 16), "gpt3-175b": (4, 8, None, 12, 1, None),
           "llama3.1-8b (v25.02)": (1, 1, 2, None, 1, 32),
           "llama3.1-70b (v25.02)": (4, 4, 2, 5, 1, 64),
           "llama3.1-405b (v25.02)": (8, 9, 2, 7, 1, 63),
           "nemotron4-15b (v25.02)": (4, 1, None, None, 4, 4),
           "gpt3-175b (v25.02)": (4, 8, None, 6, 1, None),
           "llama3.1-8b (v25.04)": (1, 1, 2, None, 1, 32),
           "llama3.1-70b (v25.04)": (4, 4, 2, 5, 1, 64),
           "llama3.1-405b (v25.04)": (8, 8, 2, 8, 1, 64),
           "nemotron4-15b (v25.04)": (2, 1, None, None, 2, 4),
           "nemotron4-340b (v25.04)": (8, 8, None, 12, 1, 16),
           "nemotron4-15b (v25.05)": (2, 1, None, None, 2, 4),
           "nemotron4-340b (v25.05)": (8, 8, None, 12, 1, 16),
           "llama3.1-405b (v25.05.01)": (8, 8, 2, 8, 1, 64)}


def notes_flops(model: str) -> float:
    """Each README's "Notes": model flops of one sequence, by its own formula and the
    sizes it states (Llama: 12 L h^2 (1 + kv/a + s/h) + 18 L f h + 6 V h per token;
    Nemotron and GPT-3: 24 L h^2 + 12 L h s + 48 L h^2 + 6 V h, GPT-3's V 51,200)."""
    def llama(s, layers, h, f, a, kv, vocab):
        return s * (12 * layers * h * h * (1 + kv / a + s / h) + 18 * layers * f * h
                    + 6 * vocab * h)

    def nemotron(s, layers, h, vocab):
        return s * (24 * layers * h * h + 12 * layers * h * s + 48 * layers * h * h
                    + 6 * vocab * h)

    return {
        "llama3.1-8b": lambda: llama(8192, 32, 4096, 14336, 32, 8, 128256),
        "llama3.1-70b": lambda: llama(8192, 80, 8192, 28672, 64, 8, 128256),
        "llama3.1-405b": lambda: llama(8192, 126, 16384, 53248, 128, 16, 128256),
        "nemotron4-15b": lambda: nemotron(4096, 32, 6144, 256000),
        "nemotron4-340b": lambda: nemotron(4096, 96, 18432, 256000),
        "gpt3-175b": lambda: nemotron(2048, 96, 12288, 51200),
    }[model]()


@pytest.fixture(scope="module")
def compared() -> list[dict]:
    return published_h100.compare(runs=published_dgxc.RUNS)


def test_the_step_times_give_the_readmes_mfu():
    # MFU = batch x model flops / step / GPUs / 989 TFLOP/s, to the printed rounding;
    # one cell disagrees in the source itself: 70B on 2,048 GPUs prints 14.98 s but
    # the MFU (and tokens/s) of 14.92 s, the column before; the step time is kept
    mismatched = []
    for recipe in published_dgxc.RECIPES + published_dgxc.LATER_RECIPES:
        for gpus, batch, step_s, mfu in recipe.columns:
            derived = recipe.flops_per_sequence * batch / step_s / gpus / 989e12 * 100
            if abs(derived - mfu) > 0.05:
                mismatched.append((recipe.release, recipe.model, gpus))
    assert mismatched == [("v24.11.1", "llama3.1-70b", 2048)]
    assert sum(len(r.columns) for r in published_dgxc.RECIPES) == 32
    assert sum(len(r.columns) for r in published_dgxc.LATER_RECIPES) == 56
    assert len(published_dgxc.RUNS) == 32 + 56


def test_the_flop_counts_are_the_readmes_notes():
    # the constants are the READMEs' (three digits); their formulas on the sizes the
    # notes state give them; the later releases keep them, but for Nemotron from v25.05
    # (v25.04.01's "Fixed MFU formula"): K and V by the 8 groups, 12 L h^2 (1 + kv/a)
    for recipe in published_dgxc.RECIPES:
        assert notes_flops(recipe.model) == pytest.approx(recipe.flops_per_sequence,
                                                          rel=0.005), recipe.model

    def nemotron_gqa(layers, h, heads):
        s, kv, vocab = 4096, 8, 256000
        return s * (12 * layers * h * h * (1 + kv / heads) + 12 * layers * h * s
                    + 48 * layers * h * h + 6 * vocab * h)

    for recipe in published_dgxc.LATER_RECIPES:
        model = recipe.model.split()[0]
        expected = (nemotron_gqa(*{"nemotron4-15b": (32, 6144, 48),
                                   "nemotron4-340b": (96, 18432, 96)}[model])
                    if recipe.release == "v25.05" else notes_flops(model))
        assert expected == pytest.approx(recipe.flops_per_sequence, rel=0.005), recipe


def test_the_planned_shapes_are_the_recipes():
    # the Llama and GPT-3 shapes by Megatron's count (which the Llama notes use; for
    # GPT-3's MHA the two formulas agree) match the notes but for the vocabulary the
    # recipe ran with (405B: the GPT-2 tokenizer, 0.3%); Nemotron's notes count every
    # attention projection h x h (24 L h^2) where its 8 key/value groups make K and V
    # 12 times narrower
    for name in ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "gpt3-175b"):
        shape = published_dgxc.MODELS[name]
        assert published_h100.megatron_flops(shape, 1) == pytest.approx(
            notes_flops(name), rel=0.005), name
    for name in ("nemotron4-15b", "nemotron4-340b"):
        shape = published_dgxc.MODELS[name]
        assert shape.kv_heads == 8 and shape.ffn == 4 * shape.d_model
        assert published_h100.megatron_flops(shape, 1) < 0.9 * notes_flops(name)


def test_each_layout_is_its_tables_header():
    for run in published_dgxc.RUNS:
        model = run.row.split(":")[0]
        tp, pp, cp, vp, micro, accum = HEADERS[model]
        c = run.config
        assert (c.tp, c.pp, c.cp, c.micro_batch_size) == (tp, pp, cp or 1, micro)
        assert c.virtual_stages == (vp or 1)
        assert c.dp * c.tp * c.pp * c.cp == run.gpus
        if accum is not None:
            assert c.global_batch_size == accum * micro * c.dp, run.row
        assert not run.fitted
        # what every recipe sets: the distributed optimizer with both overlaps, bf16
        # gradient sync, SP and the userbuffers overlap with TP
        assert c.zero == 1 and c.overlap_param_gather and c.overlap_grad_reduce
        # (v25.02's Nemotron-4 15B dropped grad_sync_dtype: NeMo's default, fp32)
        assert c.grad_accum_dtype == ("fp32" if model == "nemotron4-15b (v25.02)" else "bf16")
        assert c.sequence_parallel == c.tp_comm_overlap == (c.tp > 1)


# what each recipe's yaml and scripts set beyond the table's header (module docstring):
# bucket_cap_mb, recomputation, dropout, cross_entropy_loss_fusion, the padded
# vocabulary, key/value groups, the attention kernel NVTE_FUSED_ATTN picks
RECIPE_SETTINGS = {
    "llama3.1-8b": (75, None, 0.0, True, 128256, 8, "cudnn"),
    "llama3.1-70b": (75, None, 0.0, True, 128512, 8, "cudnn"),
    "llama3.1-405b": (125, None, 0.0, True, 51200, 16, "cudnn"),
    "nemotron4-15b": (100, None, 0.0, True, 256000, 8, "cudnn"),
    "nemotron4-340b": (50, "selective", 0.0, True, 256000, 8, "flash2"),
    "gpt3-175b": (220, None, 0.1, False, 50688, 96, "flash2"),
    # v25.02: v24.11.1's yamls for Llama; Megatron-Core's default bucket for Nemotron-4
    # 15B, max(40M, 1M x DP) bf16 parameters (None: checked apart); cuDNN for GPT-3
    "llama3.1-8b (v25.02)": (75, None, 0.0, True, 128256, 8, "cudnn"),
    "llama3.1-70b (v25.02)": (75, None, 0.0, True, 128512, 8, "cudnn"),
    "llama3.1-405b (v25.02)": (125, None, 0.0, True, 51200, 16, "cudnn"),
    "nemotron4-15b (v25.02)": (None, None, 0.0, True, 256000, 8, "cudnn"),
    "gpt3-175b (v25.02)": (220, None, 0.1, False, 50688, 96, "cudnn"),
    # v25.04 on, NeMo 2.0's recipes: buckets of 128 Mi bf16 parameters (256 MiB) but one
    # a model chunk where PP, VP and DP > 1 ("chunk"); no recomputation; 405B as released
    # (8 groups, 128,256 padded to 1,024 x 126); Nemotron's NullTokenizer(256000) has
    # 256,001 entries, padded to 128 x TP
    "llama3.1-8b (v25.04)": (256, None, 0.0, True, 128256, 8, "cudnn"),
    "llama3.1-70b (v25.04)": ("chunk", None, 0.0, True, 128512, 8, "cudnn"),
    "llama3.1-405b (v25.04)": ("chunk", None, 0.0, True, 129024, 8, "cudnn"),
    "nemotron4-15b (v25.04)": (256, None, 0.0, True, 256256, 8, "cudnn"),
    "nemotron4-340b (v25.04)": ("chunk", None, 0.0, True, 257024, 8, "cudnn"),
    "nemotron4-15b (v25.05)": (256, None, 0.0, True, 256256, 8, "cudnn"),
    "nemotron4-340b (v25.05)": ("chunk", None, 0.0, True, 257024, 8, "cudnn"),
    "llama3.1-405b (v25.05.01)": ("chunk", None, 0.0, True, 129024, 8, "cudnn"),
}


def test_each_run_has_its_recipes_settings():
    for run in published_dgxc.RUNS:
        model = run.row.split(":")[0]
        bucket, recompute, dropout, fusion, vocab, kv, kernel = RECIPE_SETTINGS[model]
        c, shape = run.config, run.shape
        if bucket is None:  # Megatron-Core's default
            bucket = max(40e6, 1e6 * c.dp * c.cp) * 2 / 2**20
        if bucket == "chunk":  # each model chunk one bucket: holds the largest, not two
            per_layer = sum(shape.layer_params(c.tp)) * 2 / 2**20
            largest = max(c.layer_split or [shape.n_layer // (c.pp * c.virtual_stages)])
            assert c.dp > 1 and c.pp > 1 and c.virtual_stages > 1
            assert largest * per_layer <= c.bucket_size_mb < 2 * largest * per_layer
            bucket = c.bucket_size_mb
        assert c.bucket_size_mb == bucket and c.recompute_granularity == recompute
        assert shape.dropout == dropout and c.cross_entropy_loss_fusion == fusion
        assert (shape.vocab_size, shape.kv_heads) == (vocab, kv)
        assert run.attention_kernel == kernel, run.row
        # the padding: a multiple of 128 x TP (make_vocab_size_divisible_by: 128)
        assert shape.vocab_size % (128 * c.tp) == 0


def test_every_run_is_within_ten_percent_but_gpt3s_on_256_gpus_and_more(compared):
    # NeMo lays its ranks out in Megatron-LM's default order (pp slowest), so GPT-3's
    # data-parallel rings (TP 4) have two members a node and cross nodes on two NICs:
    # planned so, its v24.11.1 columns from 256 GPUs on read +10.3% to +12.0%
    # (docs/planner.md, "A fourth stack"); Nemotron-4 340B on 2,048 GPUs +10.4%, read
    # +8.2% while its distributed optimizer was given DeepSpeed's two reductions in
    # flight, which stalled its backwards
    off = {r["row"].split(",")[0] + f", {r['gpus']}" for r in compared
           if abs(r["error"]) > published_h100.TOLERANCE}
    assert off == {f"gpt3-175b: tp 4, {gpus}" for gpus in (256, 512, 1024, 2048)} | {
        "nemotron4-340b: tp 8, 2048"}
    assert all(abs(r["error"]) < 0.125 for r in compared)
    # and the error is the ratio of the step times: the source's count cancels
    for run, row in zip(published_dgxc.RUNS, compared, strict=True):
        published_step = run.flops(run.shape, run.config.global_batch_size) / (
            run.tflops * 1e12 * run.gpus)
        assert row["error"] == pytest.approx(published_step / row["step_s"] - 1,
                                             rel=1e-9)


def test_the_tp_overlap_is_what_the_tp_rows_need(compared):
    # the recipes turn on Transformer Engine's userbuffers overlap; without it the
    # planner reads every TP row slower than it was, Nemotron-4 15B (TP 4, 4 sequences
    # a micro-batch) most

    tp_runs = [run for run in published_dgxc.RUNS if run.config.tp > 1]
    exposed = published_h100.compare(runs=tuple(
        replace(run, config=replace(run.config, tp_comm_overlap=False)) for run in tp_runs))
    overlapped = [r for r in compared if r["row"] in {run.row for run in tp_runs}]
    assert all(e["error"] < o["error"] - 0.005 for e, o in
               zip(exposed, overlapped, strict=True))
    worst = min(exposed, key=lambda r: r["error"])
    assert worst["row"].startswith("nemotron4-15b") and worst["error"] < -0.10


def test_the_named_kernel_prices_the_rows_that_name_flashattention2():
    runs = [run for run in published_dgxc.RUNS if run.attention_kernel == "flash2"]
    assert {run.row.split(":")[0] for run in runs} == {"nemotron4-340b", "gpt3-175b"}
    from minipar.plan import presets

    h100 = presets.cluster("h100-80gb")
    for run in runs[:1] + runs[-1:]:
        at_flash2 = estimate(run.shape, run.config, h100.with_attention_kernel("flash2"))
        at_cudnn = estimate(run.shape, run.config, h100)
        assert at_flash2.step_time > at_cudnn.step_time


def test_cli_source_dgxc_prints_the_rows_and_their_summary(capsys):
    from minipar.cli import main

    assert main(["plan", "--compare-published", "--source", "dgxc"]) == 0
    out = capsys.readouterr().out
    assert "DGXC, held out: 32 runs, 27 within 10%" in out
    assert "README," not in out and "MPT," not in out and "DGXC 25," not in out
    assert main(["plan", "--compare-published", "--source", "dgxc-25"]) == 0
    assert "DGXC 25, held out: 56 runs, 56 within 10%" in capsys.readouterr().out
    assert main(["plan", "--compare-published", "--json", "-"]) == 0
    h100 = json.loads(capsys.readouterr().out)["h100"]
    assert published_dgxc.DGXC in h100["sources"]
    rows = [r for r in h100["rows"] if r["source"] == published_dgxc.DGXC]
    assert len(rows) == 32 and not any(r["fitted"] for r in rows)
    later = [r for r in h100["rows"] if r["source"] == published_dgxc.DGXC_LATER]
    assert len(later) == 56 and not any(r["fitted"] for r in later)
    assert {r["attention_kernel"] for r in rows} == {"cudnn", "flash2"}


def test_nemo2s_405b_counts_the_embedding_and_the_loss_as_layers_of_the_split():
    # llama31_405b.py's account_for_embedding_in_pipeline_split and ..._loss_...: 126
    # layers + 2 over PP 8 x VP 8 = 2 a virtual stage, so the first and the last hold 1
    runs = [run for run in published_dgxc.RUNS if run.row.startswith("llama3.1-405b (v25.0")
            and "(v25.02)" not in run.row]
    assert len(runs) == 4
    for run in runs:
        split = run.config.layer_split
        assert len(split) == 64 and sum(split) == 126 and split[0] == split[-1] == 1


def test_the_ring_latency_keeps_large_data_parallel_groups_in_line(compared):
    # Nemotron-4 15B at TP 2 (v25.04): DP 8 to 1,024; the published step grows 4.5%
    # from 16 to 2,048 GPUs. A ring charging the network's latency on every one of its
    # n - 1 steps (here: NVLink's latency raised to the network's, which also adds a few
    # ms to the TP collectives inside each node) reads the 2,048-GPU row at about -19%;
    # NCCL's own count, the network's latency only on the steps between nodes, keeps it
    # within 10% (minipar.distributed.clock.collective_time)
    rows = [r for r in compared if r["row"].startswith("nemotron4-15b (v25.04)")]
    assert len(rows) == 8 and all(abs(r["error"]) <= published_h100.TOLERANCE for r in rows)
    run = next(run for run in published_dgxc.RUNS
               if run.row.startswith("nemotron4-15b (v25.04)") and run.gpus == 2048)
    from minipar.plan import presets

    h100 = presets.cluster("h100-80gb")
    every_step = replace(h100, intra_node_latency=h100.inter_node_latency)
    (old,) = published_h100.compare(every_step, (run,))
    assert old["error"] < -0.15


# ------------------------------------------------------------------ the FP8 tables
@pytest.fixture(scope="module")
def compared_fp8() -> list[dict]:
    return published_h100.compare(runs=published_dgxc.FP8_RUNS)


def test_the_fp8_step_times_give_the_readmes_mfu_of_the_fp8_peak():
    # MFU = batch x model flops / step / GPUs / 1979 TFLOP/s ("peak theoretical
    # throughput for H100 FP8"), to the printed rounding (v25.05's 340B prints 35%)
    for recipe in published_dgxc.FP8_RECIPES + published_dgxc.LATER_FP8_RECIPES:
        for gpus, batch, step_s, mfu in recipe.columns:
            derived = recipe.flops_per_sequence * batch / step_s / gpus / 1979e12 * 100
            assert derived == pytest.approx(mfu, abs=0.06), (recipe.release, recipe.model)
    fitted = [run for run in published_dgxc.FP8_RUNS if run.fitted]
    assert len(fitted) == 32 and len(published_dgxc.FP8_RUNS) == 32 + 56
    assert {run.source for run in fitted} == {published_dgxc.DGXC_FP8}


def test_each_fp8_table_is_its_bf16_tables_layout_in_fp8_but_v25_04s_70b():
    # every FP8 table's header is its BF16 table's, but NeMo 2.0's Llama 3.1 70B recipe
    # runs FP8 at PP 8 and no CP (llama31_utils.py at NeMo d2b21556)
    pairs = (list(zip(published_dgxc.RECIPES, published_dgxc.FP8_RECIPES, strict=True))
             + list(zip(published_dgxc.LATER_RECIPES, published_dgxc.LATER_FP8_RECIPES,
                        strict=True)))
    differs = []
    for bf16, fp8 in pairs:
        assert fp8.fp8 and not bf16.fp8 and fp8.model == bf16.model
        assert fp8.release == bf16.release
        assert [c[:2] for c in fp8.columns] == [c[:2] for c in bf16.columns]
        if (fp8.tp, fp8.pp, fp8.cp, fp8.vp, fp8.micro) != (bf16.tp, bf16.pp, bf16.cp,
                                                          bf16.vp, bf16.micro):
            differs.append((fp8.release, fp8.model, fp8.pp, fp8.cp))
    assert differs == [("v25.04", "llama3.1-70b", 8, 1)]
    # every FP8 script sets fp8_hybrid and FP8 parameters (fp8_params / NeMo 2.0's
    # bf16_with_fp8_mixed): Megatron-LM's --fp8-format hybrid --fp8-param-gather
    assert {(run.config.fp8_format, run.config.fp8_param_gather)
            for run in published_dgxc.FP8_RUNS} == {("hybrid", True)}


def rms_log_error(rows) -> float:
    return (sum(math.log(1 + r["error"]) ** 2 for r in rows) / len(rows)) ** 0.5


def test_the_fp8_gemm_efficiency_is_the_fit_on_v24_11_1s_fp8_runs(compared_fp8):
    # benchmarks/fit_time_model.py fits it on a grid of 0.01; the kept value is its
    # minimum: both neighbours fit the 32 runs worse
    from minipar.plan import presets

    fitted = [run for run in published_dgxc.FP8_RUNS if run.fitted]
    base = presets.cluster("h100-80gb")
    kept = base.roofline.fp8_gemm_efficiency

    def rms(efficiency):
        cluster = replace(base, roofline=base.roofline.replace(
            fp8_gemm_efficiency=efficiency))
        return rms_log_error(published_h100.compare(cluster, fitted))

    # (the fit moved to 0.59 when the distributed optimizer's rows lost DeepSpeed's
    # limit of reductions in flight: 0.0702 there, 0.0705 at the kept 0.60, within 0.5%)
    at_kept = rms_log_error([r for r in compared_fp8 if r["fitted"]])
    assert kept == 0.60 and at_kept == pytest.approx(0.0705, abs=5e-5)
    assert at_kept < rms(kept + 0.01) and at_kept < 1.005 * rms(kept - 0.01)


def test_the_fp8_rows_outside_ten_percent_are_the_named_ones(compared_fp8):
    # What the note and docs/planner.md report, held as a specification: of v24.11.1's
    # 32 fitted rows five are out (the 8B on 8 to 32 GPUs, read slow, and GPT-3 on 512
    # and 1,024 GPUs, read fast; the latter's 6.72 s is 13% slower than its own 128-GPU
    # column); of the 56 held out, 18: the later releases' Llama 3.1 8B (TP 1) and NeMo
    # 2.0's 70B at PP 8, read slow, and Nemotron-4 15B at TP 2 on 1,024 and 2,048 GPUs
    off = {r["row"].split(":")[0] + f" {r['gpus']}" for r in compared_fp8
           if abs(r["error"]) > published_h100.TOLERANCE}
    assert off == {"llama3.1-8b 8", "llama3.1-8b 16", "llama3.1-8b 32", "gpt3-175b 512",
                   "gpt3-175b 1024",
                   *(f"llama3.1-8b ({release}) {gpus}" for release in ("v25.02", "v25.04")
                     for gpus in (8, 16, 32, 64, 128)),
                   *(f"llama3.1-70b (v25.04) {gpus}" for gpus in (64, 128, 256, 512, 1024,
                                                                   2048)),
                   "nemotron4-15b (v25.04) 1024", "nemotron4-15b (v25.04) 2048"}
    assert all(abs(r["error"]) < 0.17 for r in compared_fp8)


def test_fp8_is_what_the_fp8_rows_need(compared_fp8):
    # planned in bf16, every FP8 row reads 17% or more slower than it ran (-18% to -34%):
    # FP8 moves each row up by 14 to 33 points
    as_bf16 = published_h100.compare(runs=tuple(
        replace(run, config=replace(run.config, fp8_format=None, fp8_param_gather=False))
        for run in published_dgxc.FP8_RUNS))
    assert all(b["error"] < -0.17 for b in as_bf16)
    assert all(b["error"] < f["error"] - 0.14 for b, f in
               zip(as_bf16, compared_fp8, strict=True))


def test_cli_source_dgxc_fp8_prints_the_fitted_and_the_held_out_rows(capsys):
    from minipar.cli import main

    assert main(["plan", "--compare-published", "--source", "dgxc-fp8"]) == 0
    out = capsys.readouterr().out
    assert "DGXC FP8, fitted: 32 runs, 27 within 10%" in out and "DGXC," not in out
    # the uniform model has no FP8 roof: without --source it leaves the FP8 rows out
    assert main(["plan", "--compare-published", "--efficiency", "0.5"]) == 0
    assert "FP8" not in capsys.readouterr().out.split("sources:")[0]
    assert main(["plan", "--compare-published", "--efficiency", "0.5", "--source",
                 "dgxc-fp8"]) == 2
    assert "uniform model" in capsys.readouterr().err
