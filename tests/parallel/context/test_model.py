"""A GPT cut along the sequence (model.py, `parallelize_context`) trains as one device
does, alone and with every other strategy, and its checkpoints resume under any cp."""

from __future__ import annotations

import numpy as np
import pytest

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
