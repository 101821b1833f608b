"""FP8 training in the planner (minipar/plan/fp8.py): Transformer Engine's FP8 linear
layers on the H100's FP8 tensor cores, Megatron-LM's `--fp8-format`.

The byte counts below are worked by hand from TE's kernels (fp8.py's docstring): a bf16
tensor cast to FP8 and its FP8 transpose moves 2 + 1 + 1 bytes an element; an FP8 GEMM
reads its operands at 1 byte and writes bf16."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from minipar.distributed.roofline import H100_SXM_80GB
from minipar.errors import ConfigError
from minipar.plan import presets
from minipar.plan.advisor import advise
from minipar.plan.cli import main
from minipar.plan.estimate import estimate
from minipar.plan.export import megatron_args
from minipar.plan.fp8 import fp8_linear_kernels
from minipar.plan.kernels import layer_kernels, stage_kernels
from minipar.plan.layout import ParallelConfig, stage_plans
from minipar.plan.lint import lint
from minipar.plan.traffic import stage_traffic

LLAMA = presets.model("llama3-8b").with_seq_len(4096)


def test_an_fp8_linear_layer_casts_its_input_and_gradient_and_runs_three_fp8_gemms():
    m, n, k = 1024, 4096, 2048  # (m, k) @ (k, n): tokens, out, in
    forward, backward = fp8_linear_kernels(m, n, k, 2, bias=False)
    cast_x, fprop = forward
    assert cast_x.nbytes == 4 * m * k and cast_x.flops == 0  # read 2, write 1 + 1
    assert fprop.fp8 and fprop.gemm == (1, m, n, k) and fprop.flops == 2 * m * n * k
    assert fprop.nbytes == m * k + k * n + 2 * m * n  # FP8 operands, bf16 output
    cast_dy, dgrad, wgrad = backward
    assert cast_dy.nbytes == 4 * m * n
    assert dgrad.fp8 and dgrad.gemm == (1, m, k, n) and dgrad.nbytes == m * n + n * k + 2 * m * k
    assert wgrad.fp8 and wgrad.gemm == (1, k, n, m) and wgrad.nbytes == m * k + m * n + 2 * k * n


def test_after_a_layernorm_the_norm_writes_fp8_and_backward_transposes_it():
    m, n, k = 1024, 4096, 2048
    forward, backward = fp8_linear_kernels(m, n, k, 2, bias=False, input_in_fp8=True)
    assert [kernel.fp8 for kernel in forward] == [True]  # no cast: the norm wrote FP8
    cast_dy, transpose_x, dgrad, wgrad = backward
    assert cast_dy.nbytes == 4 * m * n and transpose_x.nbytes == 2 * m * k  # read 1, write 1
    assert dgrad.fp8 and wgrad.fp8


def test_a_row_parallel_layer_under_sp_casts_its_shard_of_dy_and_transposes_the_whole():
    m, n, k, tp = 1024, 4096, 2048, 4
    _, backward = fp8_linear_kernels(m, n, k, 2, bias=False, grad_gathered=tp)
    cast_shard, transpose_dy = backward[:2]
    assert cast_shard.nbytes == 3 * m * n // tp  # read 2, write 1, of 1/tp of the rows
    assert transpose_dy.nbytes == 2 * m * n  # after the FP8 all-gather, every row


@pytest.mark.parametrize("shape", [LLAMA, presets.model("gpt2")], ids=lambda s: s.name)
@pytest.mark.parametrize("tp,sp", [(1, False), (4, True)])
def test_fp8_changes_the_roof_not_the_arithmetic(shape, tp, sp):
    b = 1
    bf16 = layer_kernels(shape, b, tp, sp, flash_attention=True)
    fp8 = layer_kernels(shape, b, tp, sp, flash_attention=True, fp8=True)
    for plain, quantized in zip(bf16, fp8, strict=True):
        assert sum(k.flops for k in quantized) == pytest.approx(sum(k.flops for k in plain),
                                                                rel=1e-12)
    # the four linear layers' six GEMMs each way on FP8; attention stays on bf16's roof
    assert sum(k.fp8 for k in fp8[0]) == 4 and sum(k.fp8 for k in fp8[1]) == 8
    assert not any(k.fp8 for k in fp8[0] if k.attention is not None)


def test_the_first_norm_writes_one_byte_an_element_under_fp8():
    shape, b = LLAMA, 1
    tokens, h = b * shape.seq_len, shape.d_model
    norm_bf16 = layer_kernels(shape, b)[0][0]
    norm_fp8 = layer_kernels(shape, b, fp8=True)[0][0]
    assert norm_bf16.nbytes - norm_fp8.nbytes == tokens * h  # writes 1 byte, not 2


def test_an_fp8_gemm_runs_at_the_fp8_peak_times_its_efficiency():
    roofline = H100_SXM_80GB.replace(fp8_gemm_efficiency=H100_SXM_80GB.gemm_efficiency)
    big = (1, 8192, 8192, 8192)
    assert roofline.gemm_flops(*big[:3], fp8=True) == pytest.approx(
        1979 / 989 * roofline.gemm_flops(*big[:3]), rel=1e-12)  # the datasheet's peaks
    forward, _ = fp8_linear_kernels(8192, 8192, 8192, 2, bias=False, input_in_fp8=True)
    # 2048 tiles of 256 x 128 in 16 waves of 132 SMs: 2048 / 2112 of the slots filled
    assert roofline.seconds(forward[0]) == pytest.approx(
        2 * 8192**3 / (1979e12 * roofline.gemm_efficiency * 2048 / 2112), rel=1e-12)


def test_fp8_is_faster_than_bf16_on_the_same_layout():
    config = ParallelConfig(dp=2, tp=4, pp=1, zero=1, sequence_parallel=True,
                            flash_attention=True, global_batch_size=16)
    cluster = presets.cluster("h100-80gb")
    bf16 = estimate(LLAMA, config, cluster).time["step_s"]
    fp8 = estimate(LLAMA, config.replace(fp8_format="hybrid"), cluster).time["step_s"]
    assert 0.5 < fp8 / bf16 < 0.95


def test_fp8_needs_bf16_mixed_precision_and_a_known_format():
    with pytest.raises(ConfigError, match="bf16 mixed precision"):
        ParallelConfig(precision="fp32", fp8_format="hybrid")
    with pytest.raises(ConfigError, match="e4m3, hybrid"):
        ParallelConfig(fp8_format="e5m2")


def test_an_a100_has_no_fp8_tensor_cores_and_the_uniform_model_no_gemms():
    config = ParallelConfig(fp8_format="hybrid", global_batch_size=8)
    with pytest.raises(ConfigError, match="no FP8 tensor cores"):
        estimate(LLAMA, config, presets.cluster("a100-80gb"))
    uniform = replace(presets.cluster("h100-80gb"), roofline=None)
    with pytest.raises(ConfigError, match="uniform model"):
        estimate(LLAMA, config, uniform)


def test_the_cli_plans_fp8_and_names_both_mfus(capsys):
    status = main(["plan", "--model", "llama3-8b", "--cluster", "h100-80gb", "--dp", "8",
                   "--global-batch-size", "64", "--fp8-format", "hybrid"])
    out, _ = capsys.readouterr()
    assert status == 0
    assert "of the bf16 peak" in out and "of FP8's)" in out and "GEMMs in FP8 (hybrid)" in out
    assert main(["plan", "--model", "llama3-8b", "--cluster", "a100", "--dp", "8",
                 "--fp8-format", "hybrid"]) == 2
    assert "no FP8 tensor cores" in capsys.readouterr().err


def test_the_json_names_what_the_fp8_and_the_bf16_constants_were_fitted_on():
    config = ParallelConfig(dp=8, global_batch_size=64, fp8_format="hybrid")
    cluster = presets.cluster("h100-80gb")
    model = estimate(presets.model("llama3-8b"), config, cluster).to_dict()["compute_model"]
    assert "60% of the FP8 peak" in model and "32 FP8 DGX Cloud" in model
    assert cluster.calibration in model  # the bf16 constants' runs


def test_a_search_in_fp8_plans_every_candidate_in_fp8(capsys):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "h100-80gb", "--gpus", "8",
                 "--fp8-format", "e4m3", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert {r["config"]["fp8_format"] for r in advice["ranked"]} == {"e4m3"}


def test_the_megatron_export_sets_the_planned_fp8_format():
    config = ParallelConfig(dp=8, fp8_format="hybrid", global_batch_size=64)
    args = megatron_args(LLAMA, config, "megatron-lm")
    assert args[args.index("--fp8-format") + 1] == "hybrid"
    assert "--fp8-format" not in megatron_args(LLAMA, config.replace(fp8_format=None),
                                               "megatron-lm")


def test_te_keeps_an_fp8_copy_and_transpose_of_each_gemm_weight_unless_they_are_fp8_params():
    # Llama 3 8B on one GPU: per layer the QKV (4096 x (4096 + 2 x 1024)), projection
    # (4096 x 4096), fc1 (4096 x 2 x 14336) and fc2 (14336 x 4096) weights: 4096 x 53248
    cluster = presets.cluster("h100-80gb")
    config = ParallelConfig(zero=1, global_batch_size=1)  # (FP8 parameters need ZeRO-1)
    bf16 = estimate(LLAMA, config, cluster).memory["params"]
    fp8 = estimate(LLAMA, config.replace(fp8_format="hybrid"), cluster).memory["params"]
    assert fp8 - bf16 == 2 * 32 * 4096 * 53248  # 1 + 1 bytes each, 32 layers
    fp8_params = config.replace(fp8_format="hybrid", fp8_param_gather=True)
    assert estimate(LLAMA, fp8_params, cluster).memory["params"] == bf16


def test_fp8_saves_the_norms_outputs_and_fc2s_input_in_one_byte():
    # with sequence parallelism over t: -(2 h T/t + f T/t) + h T/t (the projection's FP8
    # copy beside its bf16 input) = -(h + f) T / t a layer, for T tokens in flight
    cluster = presets.cluster("h100-80gb")
    config = ParallelConfig(tp=4, sequence_parallel=True, flash_attention=True,
                            global_batch_size=1)
    bf16 = estimate(LLAMA, config, cluster).memory["activations"]
    fp8 = estimate(LLAMA, config.replace(fp8_format="hybrid"), cluster).memory["activations"]
    tokens, h, f = 4096, 4096, 14336
    assert bf16 - fp8 == 32 * (h + f) * tokens // 4


def test_fp8_param_gather_needs_fp8_and_zero_1_and_is_exported():
    with pytest.raises(ConfigError, match="add --fp8-format"):
        ParallelConfig(zero=1, fp8_param_gather=True)
    # Megatron-LM: "--fp8-param-gather only supported with distributed optimizer"
    with pytest.raises(ConfigError, match="use --zero 1, not 0"):
        ParallelConfig(fp8_format="hybrid", fp8_param_gather=True)
    config = ParallelConfig(dp=8, zero=1, fp8_format="hybrid", fp8_param_gather=True,
                            global_batch_size=64)
    assert "--fp8-param-gather" in megatron_args(LLAMA, config, "megatron-lm")


def test_a_layer_under_sp_casts_what_te_casts_and_nothing_else():
    # Llama 3 8B at TP 4 with sequence parallelism, one sequence of T = 4096 tokens; the
    # casts and transposes (the kernels with no arithmetic), in bytes, by hand:
    shape, tp, T = LLAMA, 4, 4096
    h, f, qkv, fc1 = 4096, 14336, 4096 + 2 * 1024, 2 * 14336
    forward, backward = layer_kernels(shape, 1, tp, True, flash_attention=True, fp8=True)
    moves = sorted(k.nbytes for k in forward if k.flops == 0)
    # the projection's and fc2's inputs: cast and transposed (the norms write FP8)
    assert moves == sorted([4 * T * h // tp, 4 * T * f // tp])
    moves = sorted(k.nbytes for k in backward if k.flops == 0)
    assert moves == sorted([
        4 * T * qkv // tp, 4 * T * fc1 // tp,  # column-parallel dy: cast and transposed
        3 * T * h // tp, 2 * T * h,  # the projection's dy: its shard cast, gathered, transposed
        3 * T * h // tp, 2 * T * h,  # fc2's, the same
        2 * T * h, 2 * T * h])  # the gathered FP8 norm outputs, transposed for dW


def test_the_weights_are_cast_once_a_step_not_once_a_micro_batch():
    # a step of m micro-batches moves m A + W bytes in kernels without arithmetic (A: a
    # micro-batch's, W: the weights' casts): W from m = 1 and m = 8
    def moved_per_step(micro_batches):
        config = ParallelConfig(tp=4, sequence_parallel=True, flash_attention=True,
                                global_batch_size=micro_batches, fp8_format="hybrid")
        forward = stage_kernels(LLAMA, config, stage_plans(LLAMA, config)[0])["forward"]
        return micro_batches * sum(times * k.nbytes for times, kernels in forward
                                   for k in kernels if k.flops == 0)

    weights = (8 * moved_per_step(1) - moved_per_step(8)) / 7
    assert weights == pytest.approx(32 * 4 * 4096 * 53248 / 4, rel=1e-12)  # read 2,
    # write 1 + 1, of 32 layers' GEMM weights on one of 4 TP ranks


def test_sequence_parallel_gathers_move_fp8_and_the_reduce_scatters_bf16():
    config = ParallelConfig(tp=4, sequence_parallel=True, global_batch_size=1)
    stage = stage_plans(LLAMA, config)[0]

    def by_label(c):
        return {t.label: t.nbytes for t in stage_traffic(LLAMA, c, stage, 8)}

    bf16, fp8 = by_label(config), by_label(config.replace(fp8_format="hybrid"))
    for label in ("sequence-parallel all-gather (g)", "input re-gather",
                  "output-gradient all-gather"):
        assert fp8[label] * 2 == bf16[label]
    for label in ("sequence-parallel reduce-scatter", "input-gradient reduce-scatter"):
        assert fp8[label] == bf16[label]


def test_fp8_refuses_what_it_cannot_price_before_the_lint_prices_stages(capsys):
    # a pipeline on an A100: the lint prices stages first, and must say why, not trace back
    assert main(["plan", "--model", "llama3-8b", "--cluster", "a100", "--dp", "4", "--pp",
                 "2", "--fp8-format", "hybrid"]) == 2
    assert "no FP8 tensor cores" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no FP8 tensor cores"):
        lint(LLAMA, ParallelConfig(pp=2, fp8_format="hybrid", global_batch_size=4),
             presets.cluster("a100-80gb"))
    # an MoE model's experts run in FP8 in Megatron-LM (TEGroupedMLP): not priced here
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "h100-80gb", "--dp", "64",
                 "--ep", "8", "--fp8-format", "hybrid"]) == 2
    assert "TEGroupedMLP" in capsys.readouterr().err


def test_fp8_goes_with_zero_1_as_megatron_lm_runs_it():
    cluster = presets.cluster("h100-80gb")
    findings = lint(LLAMA, ParallelConfig(dp=8, zero=3, fp8_format="hybrid",
                                          global_batch_size=8), cluster)
    assert "FP8_WITH_ZERO" in {f.code for f in findings}
    advice = advise(LLAMA, 8, cluster, global_batch_size=64, fp8_format="hybrid")
    assert advice.ranked and {e.config.zero for e in advice.ranked} <= {0, 1}
    best = advice.ranked[0]
    assert best.time["mfu_fp8_peak"] == pytest.approx(best.time["mfu"] * 989 / 1979,
                                                      rel=1e-12)
