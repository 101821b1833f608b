"""Context parallelism: ring attention equals full causal attention (fp64), the ring's
traffic is what the algorithm sends, and a GPT cut along the sequence trains as one
device does."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd import functional as F
from minipar.autograd.tensor import Tensor
from minipar.parallel.context.ring_attention import (
    attending_pairs,
    chunk_ids,
    positions,
    ring_attention,
    sequence_shard,
)

B, T, H, HD = 2, 16, 2, 4


def full_attention(qkv, dout):
    x = Tensor(qkv, requires_grad=True)
    out = F.causal_self_attention(x, HD)
    out.backward(dout)
    return out.data, x.grad


def ring_run(n, load_balance, qkv, dout):
    def rank_program():
        group = dist.new_group(range(n), "cp")
        r = dist.get_rank()
        x = Tensor(sequence_shard(qkv, r, n, load_balance), requires_grad=True)
        with dist.phase("forward"):
            out = ring_attention(x, HD, group, load_balance)
        out.backward(sequence_shard(dout, r, n, load_balance))
        return out.data, x.grad
    return dist.launch(rank_program, n, return_devices=True)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_ring_attention_equals_full_causal_attention_forward_and_backward(n, load_balance):
    rng = np.random.default_rng(0)
    qkv = rng.normal(size=(B, T, 3 * H * HD))
    dout = rng.normal(size=(B, T, H * HD))
    out, grad = full_attention(qkv, dout)
    results, _ = ring_run(n, load_balance, qkv, dout)
    for r, (local_out, local_grad) in enumerate(results):
        expected_out = sequence_shard(out, r, n, load_balance)
        expected_grad = sequence_shard(grad, r, n, load_balance)
        np.testing.assert_allclose(local_out, expected_out, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(local_grad, expected_grad, rtol=1e-11, atol=1e-13)


def test_load_balanced_layout_gives_rank_r_chunks_r_and_2n_minus_1_minus_r():
    assert chunk_ids(0, 4, True) == (0, 7) and chunk_ids(3, 4, True) == (3, 4)
    assert positions(16, 1, 2, True).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert positions(16, 0, 2, True).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 1, 2, False).tolist() == list(range(8, 16))
    every = np.sort(np.concatenate([positions(24, r, 3, True) for r in range(3)]))
    assert every.tolist() == list(range(24))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_load_balancing_gives_every_rank_the_same_chunk_pairs(n):
    pairs = [[len(attending_pairs(chunk_ids(r, n, True), chunk_ids(o, n, True)))
              for o in range(n)] for r in range(n)]
    assert len({sum(p) for p in pairs}) == 1  # every rank 2N-1 full + 2 diagonal pairs
    assert sum(pairs[0]) == 2 * n + 1
    unbalanced = [sum(len(attending_pairs(chunk_ids(r, n, False), chunk_ids(o, n, False)))
                      for o in range(n)) for r in range(n)]
    assert unbalanced == list(range(1, n + 1))  # rank r attends to r + 1 blocks


def test_ring_traffic_is_n_minus_1_kv_blocks_forward_and_twice_that_backward():
    n = 4
    rng = np.random.default_rng(1)
    qkv = rng.normal(size=(B, T, 3 * H * HD))
    dout = rng.normal(size=(B, T, H * HD))
    _, devices = ring_run(n, True, qkv, dout)
    kv_block = 2 * B * (T // n) * H * HD * 8  # K and V of my tokens, fp64
    for device in devices:
        sent = {"forward": 0, "backward": 0}
        for record in device.comm.records:
            assert record.group_kind == "cp"
            sent[record.phase] += record.sent_bytes
        # forward: N-1 hops of K/V; backward: N-1 hops of K/V and N-1 of dK/dV
        assert sent == {"forward": (n - 1) * kv_block, "backward": 2 * (n - 1) * kv_block}


# ---------------------------------------------------------------- a GPT cut over CP
CHECK = dict(steps=2, precision="fp64", check=True, seq_len=16, n_layer=2, d_model=32,
             n_head=4, micro_batch_size=2, data="synthetic", vocab_size=32)


@pytest.mark.parametrize("settings", [
    dict(cp=2), dict(cp=4), dict(cp=2, cp_load_balance=False),
    dict(cp=4, cp_load_balance=False),
    dict(cp=2, tp=2), dict(cp=2, tp=2, sequence_parallel=True),
    dict(cp=4, tp=2, sequence_parallel=True),
    dict(cp=2, pp=2, grad_accum_steps=2), dict(cp=4, pp=2, grad_accum_steps=2),
    dict(cp=2, dp=2, zero=1), dict(cp=4, dp=2, zero=1),
    dict(cp=2, dp=2, tp=2, pp=2, zero=1, sequence_parallel=True, grad_accum_steps=2),
], ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
def test_context_parallel_training_equals_one_device_in_fp64(settings):
    from minipar.train.loop import train

    report = train(**CHECK, **settings)
    equivalence = report.equivalence
    assert equivalence["passed"], equivalence["first_mismatch"]
    assert equivalence["max_rel_param_diff"] < 1e-10
    assert equivalence["max_rel_loss_diff"] < 1e-13
    # every rank of a CP group held its own tokens: coordinates gain cp
    assert sorted({r["coords"]["cp"] for r in report.ranks}) == list(range(settings["cp"]))


def test_gradients_are_averaged_over_dp_times_cp_and_cp_bytes_are_the_ring_attention():
    from minipar.train.loop import train

    report = train(**{**CHECK, "check": False, "steps": 1}, cp=2, dp=2)
    assert report.layout["groups"]["cp"] == [[0, 1], [2, 3]]
    for rank in report.ranks:
        by_group = rank["comm"]["by_group"]
        assert by_group["cp"] > 0 and by_group["dp"] > 0
        assert rank["coords"] == {"dp": rank["rank"] // 2, "pp": 0, "cp": rank["rank"] % 2,
                                  "tp": 0}


@pytest.mark.parametrize("settings, message", [
    (dict(cp=3), "does not split into 2 x cp = 6 chunks"),
    (dict(cp=3, cp_load_balance=False), "does not split into cp = 3 pieces"),
    (dict(cp=2, tp=4, sequence_parallel=True, seq_len=12), "do not split over --tp 4"),
    (dict(cp=2, dropout=0.1, check=False), "attention dropout"),
    (dict(cp=2, recompute_granularity="selective"), "nothing to recompute"),
])
def test_layouts_that_cannot_cut_the_sequence_are_refused_with_the_reason(settings, message):
    from minipar.train.config import TrainConfig
    from minipar.train.mixes import check_layout

    config = TrainConfig(**{**CHECK, "vocab_size": 32, **settings})
    with pytest.raises(ValueError, match=message) as err:
        check_layout(config)
    assert str(err.value).startswith("--") and "--cp" in str(err.value)


def test_a_checkpoint_saved_under_cp_resumes_under_any_cp(tmp_path):
    from minipar.train.loop import train

    base = dict(seq_len=16, n_layer=2, d_model=32, n_head=4, micro_batch_size=2,
                data="synthetic", vocab_size=32, precision="fp64", global_batch_size=4)
    uninterrupted = train(**base, steps=4)
    train(**{**base, "global_batch_size": None}, steps=2, cp=2, dp=2, zero=1,
          save_dir=tmp_path)
    for cp in (1, 4):
        resumed = train(**base, steps=4, cp=cp, resume_from=tmp_path)
        np.testing.assert_allclose(resumed.losses, uninterrupted.losses[2:], rtol=1e-12)
