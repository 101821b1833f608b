"""Expert parallelism mixed with the other strategies, against one device in fp64: ep 2
and 4 with TP (with and without sequence parallelism), with PP (every registered
schedule; each stage trains its own MoE layers' aux loss) and with DP/ZeRO-1; the logged
loss is the LM loss with the aux loss reported apart; the dispatch bytes under TP; an
--ep checkpoint resumes bit for bit; and the mixes that still cannot run are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.errors import ConfigError
from minipar.nn import GPT
from minipar.nn import moe as moe_module
from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.train import TrainConfig, build, train
from minipar.train.data import make_stream

# 2 MoE layers of 4 experts, d_model 16, 8-token sequences, 2 sequences per micro-batch;
# capacity factor 1 drops some assignments, so dropping is inside every comparison.
SMALL = dict(seq_len=8, n_layer=2, n_head=2, d_model=16, micro_batch_size=2, steps=2,
             moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.0, precision="fp64")


def _run(**settings):
    return train(TrainConfig(**{**SMALL, **settings}))


def assert_equals_one_device(report):
    assert report.equivalence["passed"], report.equivalence.get("first_mismatch")
    assert report.equivalence["max_rel_param_diff"] < 1e-10
    # the same routing (integers: exact) and the same aux loss as the single device
    reference = report.reference.moe
    for layer, expected in zip(report.moe["layers"], reference["layers"], strict=True):
        assert layer["name"] == expected["name"]
        assert layer["tokens_per_expert"] == expected["tokens_per_expert"]
        assert layer["dropped"] == expected["dropped"] > 0
    np.testing.assert_allclose(report.moe["aux_loss"], reference["aux_loss"], rtol=1e-12)


@pytest.mark.parametrize("settings", [
    dict(dp=2, ep=2, tp=2),
    dict(dp=4, ep=4, tp=2),
    dict(dp=2, ep=2, tp=2, sequence_parallel=True, moe_layer_freq=2, moe_top_k=1),
    dict(dp=2, ep=2, pp=2, grad_accum_steps=2),                        # 1F1B
    dict(dp=2, ep=2, pp=2, grad_accum_steps=2, schedule="gpipe"),
    dict(dp=4, ep=4, pp=2, grad_accum_steps=2, zero=1),
    dict(dp=2, ep=2, tp=2, pp=2, grad_accum_steps=2, zero=1),
], ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
def test_expert_parallel_with_tp_pp_and_zero1_equals_one_device(settings):
    assert_equals_one_device(_run(check=True, **settings))


@pytest.mark.parametrize("zero", [0, 1])
def test_a_pipeline_stage_without_moe_layers_trains_like_one_device(zero):
    # every other block is MoE and each stage holds two, so stage 1 has no experts: it
    # still adds its 0 to the experts' gradient norm, which clipping reads
    report = _run(check=True, dp=2, ep=2, pp=2, n_layer=4, grad_accum_steps=2, zero=zero,
                  moe_layer_freq=2, schedule="interleaved", virtual_stages=2, grad_clip=0.01)
    assert_equals_one_device(report)
    without = {r["coords"]["pp"] for r in report.ranks if r["sharding"]["expert_numel"] == 0}
    assert without == {1}


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in ("gpipe", "1f1b")])
def test_every_other_registered_schedule_trains_moe_like_one_device(schedule):
    # interleaving, the split backward (zb-*: B, then W) and the V placements
    spec = SCHEDULES[schedule]
    virtual = max(spec.virtual_stages[0], 2 if spec.searched_virtual_stages else 1)
    report = _run(check=True, dp=2, ep=2, pp=2, n_layer=4, grad_accum_steps=4, steps=1,
                  schedule=schedule, virtual_stages=virtual)
    assert_equals_one_device(report)


def test_the_check_fails_if_a_parallel_run_loses_the_aux_loss_gradient(monkeypatch):
    # What the autoscaler prevents: a pipeline stage whose MoE layers' aux losses never
    # reach their gradient (the aux loss does not travel down the pipeline).
    backward = moe_module.MoEAuxLossAutoScaler.backward

    def without_aux_on_parallel_ranks(ctx, grad):
        out, aux, none = backward(ctx, grad)
        return out, aux * (dist.get_world_size() == 1), none

    monkeypatch.setattr(moe_module.MoEAuxLossAutoScaler, "backward",
                        staticmethod(without_aux_on_parallel_ranks))
    report = _run(check=True, dp=2, ep=2, pp=2, grad_accum_steps=2, moe_aux_loss_coeff=1.0)
    assert not report.equivalence["passed"]


def test_the_check_fails_if_the_aux_loss_is_not_weighed_one_over_micro_batches(monkeypatch):
    # The reference runs dp x m = 4 micro-batches, each rank here 2: an aux loss left at
    # weight 1 (instead of 1/m) counts twice as much in the single device's gradient.
    monkeypatch.setattr(build, "set_aux_loss_scale", lambda part, scale: None)
    report = _run(check=True, dp=2, ep=2, pp=2, grad_accum_steps=2, moe_aux_loss_coeff=1.0)
    assert not report.equivalence["passed"]


def test_logged_loss_is_the_lm_loss_and_the_aux_loss_is_reported_apart():
    # Megatron logs "lm loss" and "load_balancing_loss" apart: steps[k].loss is the
    # cross-entropy alone, moe.aux_loss[k] the summed aux losses (their sum is trained).
    report = _run(steps=1)
    config = TrainConfig(**{**SMALL, "steps": 1})
    stream = make_stream(config.data, config.vocab_size)
    idx, targets = stream.global_batch(0, config.global_batch_size, config.seq_len,
                                       config.seed)
    model = GPT(build.gpt_config(config, stream.vocab_size), seed=config.seed,
                precision="fp64")
    logits = model(idx).data                                    # (B, T, V)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    lm_loss = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    aux = sum(block.mlp.aux_loss.item() for block in model.h)
    assert report.steps[0]["loss"] == pytest.approx(lm_loss, rel=1e-12)
    assert report.moe["aux_loss"][0] == pytest.approx(aux, rel=1e-12)
    assert aux > 0.01 * 2 * 0.9  # coefficient 0.01, 2 layers, near-balanced routing


@pytest.mark.parametrize("tp", [1, 2])
def test_dispatch_bytes_per_rank_do_not_change_with_tp(tp):
    # Every TP rank holds the same tokens (replicated, or all-gathered under SP) and
    # dispatches the whole (E, C, d) buffer over its own ep group: TP halves the expert
    # bytes a rank holds, not the all-to-all bytes it sends.
    ep, steps = 2, 2
    report = _run(dp=2, ep=ep, tp=tp, steps=steps)
    tokens = SMALL["micro_batch_size"] * SMALL["seq_len"]
    capacity = math.ceil(tokens * SMALL["moe_top_k"] / SMALL["moe_num_experts"]
                         * SMALL["moe_capacity_factor"])
    buffer = SMALL["moe_num_experts"] * capacity * SMALL["d_model"] * 8   # (E, C, d) fp64
    expected = 4 * SMALL["n_layer"] * steps * (ep - 1) * buffer // ep
    assert report.moe["all_to_all_sent_bytes"] == [expected] * (2 * tp)
    d = SMALL["d_model"]
    # per expert: c_fc and c_proj weights split over TP, c_fc bias split, c_proj bias whole
    one_expert = ((d * 4 * d + 4 * d + 4 * d * d) // tp + d) * 8
    per_rank = SMALL["n_layer"] * SMALL["moe_num_experts"] // ep * one_expert
    assert report.moe["expert_param_bytes"] == [per_rank] * (2 * tp)


@pytest.mark.parametrize("settings", [dict(dp=2, ep=2, tp=2, zero=1),
                                      dict(dp=2, ep=2, pp=2, grad_accum_steps=2)],
                         ids=["dp2-ep2-tp2-zero1", "dp2-ep2-pp2"])
def test_an_ep_checkpoint_resumes_bit_identically(tmp_path, settings):
    config = TrainConfig(**{**SMALL, "steps": 3, "warmup_steps": 1, **settings})
    full = train(config, save_dir=tmp_path, save_every=1)
    resumed = train(config, resume_from=tmp_path / "step-000002")
    assert resumed.steps == full.steps[2:]            # losses, lr, grad norms: bit for bit
    assert resumed.moe["aux_loss"] == full.moe["aux_loss"][2:]
    for name, value in full.state_dict.items():
        assert np.array_equal(resumed.state_dict[name], value), name
    # ... and the same checkpoint continues under another layout (one device)
    single = train(config.replace(dp=1, ep=1, tp=1, pp=1, zero=0,
                                  grad_accum_steps=config.grad_accum_steps * 2),
                   resume_from=tmp_path / "step-000002")
    np.testing.assert_allclose(single.losses, full.losses[2:], rtol=1e-10)


@pytest.mark.parametrize("settings, flag, reason", [
    (dict(cp=2), "cp", "routing"),
    (dict(dp=2, zero=2), "zero", "expert-data-parallel group"),
    (dict(dp=2, ep=2, zero=3), "zero", "expert-data-parallel group"),
    (dict(dp=2, ep=2, offload_optimizer="cpu", zero=1), "offload_optimizer", "two engines"),
])
def test_mixes_that_cannot_run_are_refused_naming_the_flag_and_why(settings, flag, reason):
    with pytest.raises(ConfigError, match=reason) as info:
        _run(**settings)
    assert info.value.setting == flag
    assert "MoE" in str(info.value) or "--ep" in str(info.value)


def test_a_dense_checkpoint_does_not_resume_as_an_moe_model(tmp_path):
    dense = {**SMALL, "moe_num_experts": 0, "steps": 1}
    train(TrainConfig(**dense), save_dir=tmp_path)
    with pytest.raises(ConfigError) as info:
        train(TrainConfig(**{**SMALL, "steps": 2}), resume_from=tmp_path)
    assert info.value.setting == "moe_num_experts"
