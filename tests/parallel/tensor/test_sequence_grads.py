"""The step's one all-reduce of the sequence-parallel parameters' gradients
(sequence_grads.py, Megatron's finalize_model_grads) in the training loop: its count,
its bytes, its equivalence with the single device, and the refusal of a gradient that
skipped it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd.placement import PlacementError
from minipar.train import TrainConfig, train
from minipar.train import build as build_module
from minipar.train.build import build_rank_model

# ---------------------------------------------------------------------------- the step's
# all-reduce of the sequence-parallel gradients (LayerNorm weights and biases, the
# row-parallel biases): once per step, in one flat buffer, after the DP sync.
TINY = dict(seq_len=8, n_layer=2, d_model=16, n_head=4, micro_batch_size=2, steps=2,
            precision="fp64", data="synthetic", tp=2, sequence_parallel=True)
# per block ln_1 and ln_2 (weight, bias), attn.c_proj.bias and mlp.c_proj.bias; ln_f
SP_ELEMENTS = (6 * TINY["n_layer"] + 2) * TINY["d_model"]


def sp_gradient_all_reduces(report, rank: int) -> list[dict]:
    """The rank's TP all-reduces in backward: under sequence parallelism only the
    gradients' (the activations' collectives are all-gathers and reduce-scatters)."""
    return [t for t in report.transfers[rank]
            if t["group"] == "tp" and t["op"] == "all_reduce" and t["phase"] == "backward"]


def other_tp_transfers(report, rank: int) -> Counter:
    return Counter((t["op"], t["phase"], t["sent_bytes"]) for t in report.transfers[rank]
                   if t["group"] == "tp" and t not in sp_gradient_all_reduces(report, rank))


def test_the_loop_all_reduces_the_sp_gradients_once_per_step_not_per_parameter():
    """Against the per-backward path (kept where the optimizer is offloaded: its
    gradient shard leaves the GPU as its DP reduction completes): 1 call per step
    instead of one per vector and micro-batch, 1/A of the bytes, less time; every other
    TP collective the same, and the same training to rounding."""
    config = TrainConfig(**TINY, zero=1, grad_accum_steps=2)
    coalesced = train(config)
    per_backward = train(config.replace(offload_optimizer="cpu"))
    steps, accum, vectors = config.steps, config.grad_accum_steps, SP_ELEMENTS // 16
    for rank in range(config.world_size):
        once = sp_gradient_all_reduces(coalesced, rank)
        each = sp_gradient_all_reduces(per_backward, rank)
        assert len(once) == steps
        assert len(each) == steps * accum * vectors
        # ring all-reduce over 2 ranks: each sends half the buffer twice, fp64
        assert sum(t["sent_bytes"] for t in once) == steps * SP_ELEMENTS * 8
        assert sum(t["sent_bytes"] for t in each) == accum * steps * SP_ELEMENTS * 8
        assert (sum(t["end"] - t["start"] for t in once)
                < sum(t["end"] - t["start"] for t in each) / vectors)
        assert other_tp_transfers(coalesced, rank) == other_tp_transfers(per_backward, rank)
    np.testing.assert_allclose(coalesced.losses, per_backward.losses, rtol=1e-12)


@pytest.mark.parametrize("settings", [
    dict(dp=2, zero=2, grad_accum_steps=2),  # every rank all-reduces its shard's part
    dict(dp=2, pp=2, zero=1, grad_accum_steps=2, overlap_grad_reduce=False),
], ids=["dp2 tp2 zero2", "dp2 pp2 tp2 zero1 waited"])
def test_the_step_all_reduce_matches_the_single_device_on_sharded_and_3d_layouts(settings):
    """Summed over micro-batches and DP before TP (Megatron's order), the run still
    equals the single device at fp64 and repeats bit for bit; one call per step on every
    rank, and the TP-rank-0 ranks' buffers together are the model's SP gradients once
    (ZeRO splits them over DP, the pipeline over stages)."""
    config = TrainConfig(**TINY, **settings, check=True)
    report = train(config)
    assert report.equivalence["passed"]
    assert report.equivalence["max_rel_param_diff"] <= 1e-10
    assert all(len(sp_gradient_all_reduces(report, r)) == config.steps
               for r in range(config.world_size))
    tp0 = [r["rank"] for r in report.ranks if r["coords"]["tp"] == 0]
    assert (sum(t["sent_bytes"] for r in tp0 for t in sp_gradient_all_reduces(report, r))
            == config.steps * SP_ELEMENTS * 8)
    again = train(config.replace(check=False))
    assert again.losses == report.losses
    for name, value in report.state_dict.items():
        np.testing.assert_array_equal(again.state_dict[name], value, err_msg=name)


@pytest.mark.parametrize("zero", [0, 2])
def test_a_gradient_that_skips_the_step_all_reduce_is_refused(monkeypatch, zero):
    """Without the TP sum each rank's LayerNorm gradient holds only its tokens' share:
    the gradient norm refuses it before anything reads it."""
    monkeypatch.setattr(build_module, "allreduce_sequence_parallel_grads",
                        lambda *args: None)
    config = TrainConfig(**TINY, dp=2, zero=zero)
    with pytest.raises(PlacementError, match=r"(ln_\w|c_proj)\.(weight|bias): its gradient is "
                                             r"Partial\(sum\) over the tp group"):
        train(config)


def test_a_backward_after_the_step_all_reduce_and_a_second_sum_are_refused():
    """The placement follows the gradient: a backward after the sum makes it Partial
    again (the optimizer refuses it), and summing a whole gradient twice would multiply
    it by the TP size (refused too)."""
    config = TrainConfig(**{**TINY, "steps": 1}, vocab_size=32)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, 32, size=(2, TINY["seq_len"])) for _ in range(2))

    def program():
        rank = build_rank_model(config, dist.DeviceMesh(tp=2))
        rank.forward_backward([(x, y)])
        with pytest.raises(PlacementError, match="no Partial.* gradient to all-reduce"):
            rank.finalize_model_grads()
        rank.model(x, y).backward()
        with pytest.raises(PlacementError, match="its gradient is Partial"):
            rank.engine.clip_grad_norm_(1.0)
        with pytest.raises(PlacementError, match="its gradient is Partial"):
            rank.engine.step(1e-3)
        return True

    assert dist.launch(program, 2) == [True, True]
