"""Communication overlap, in every engine that has it: DP / ZeRO-1/2 buckets reduced
while backward goes on, the same under pipeline parallelism during each stage's last
micro-batch backward (Megatron's --overlap-grad-reduce), ZeRO-3 prefetch.

The specification: overlap moves *when* transfers run, nothing else. Against the run that
waits for every reduction (`overlap_grad_reduce=False`, `zero3_prefetch=False`) the
losses, the final parameters, and every rank's collectives (op, group, bytes, counted as
a multiset) are bit-identical, and the exposed communication is smaller.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from minipar.demo import DEMO_PROFILE
from minipar.train import TrainConfig, train

TINY = dict(seq_len=16, n_layer=4, d_model=32, n_head=4, micro_batch_size=2, steps=2,
            precision="fp64", data="synthetic")


def collectives(report) -> list[Counter]:
    """Per rank, the multiset of (op, group kind, bytes sent, bytes received)."""
    return [Counter((t["op"], t["group"], t["sent_bytes"], t["recv_bytes"]) for t in rank)
            for rank in report.transfers]


def exposed(report) -> float:
    return max(r["time"]["exposed_comm_s"] for r in report.ranks)


def pair(**settings):
    config = TrainConfig(**{**TINY, **settings})
    waited = train(config.replace(overlap_grad_reduce=False, zero3_prefetch=False),
                   device=DEMO_PROFILE)
    overlapped = train(config, device=DEMO_PROFILE)
    return waited, overlapped


LAYOUTS = {
    "dp2 buckets": dict(dp=2, bucket_size_mb=0.01),
    "dp2 zero1 accum 2": dict(dp=2, zero=1, bucket_size_mb=0.01, grad_accum_steps=2),
    "dp2 zero2 accum 2": dict(dp=2, zero=2, bucket_size_mb=0.01, grad_accum_steps=2),
    "dp2 zero3": dict(dp=2, zero=3),
    "dp2 zero3 checkpointing": dict(dp=2, zero=3, activation_checkpointing=True),
    "dp2 pp2 1f1b": dict(dp=2, pp=2, bucket_size_mb=0.01, grad_accum_steps=4),
    "dp2 pp2 zero1 untied": dict(dp=2, pp=2, zero=1, bucket_size_mb=0.01,
                                 grad_accum_steps=2, tie_embeddings=False),
    "dp2 pp2 interleaved": dict(dp=2, pp=2, schedule="interleaved", virtual_stages=2,
                                bucket_size_mb=0.01, grad_accum_steps=4),
    "dp2 tp2 sp pp2 zero1": dict(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True,
                                 bucket_size_mb=0.01, grad_accum_steps=2),
}


@pytest.mark.parametrize("settings", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_overlap_changes_when_transfers_run_and_nothing_else(settings):
    waited, overlapped = pair(**settings)
    assert overlapped.losses == waited.losses
    for name, value in waited.state_dict.items():
        np.testing.assert_array_equal(overlapped.state_dict[name], value, err_msg=name)
    assert collectives(overlapped) == collectives(waited)
    assert exposed(overlapped) < exposed(waited)


def test_a_pipeline_stage_reduces_during_its_last_backward_not_after_the_flush():
    """Megatron's --overlap-grad-reduce: the last stage finishes its last backward long
    before the first stage does (1F1B drains towards stage 0), so its DP all-reduces
    start before the pipeline's flush; waited, they all start after it."""
    waited, overlapped = pair(dp=2, pp=2, bucket_size_mb=0.01, grad_accum_steps=4)
    last_stage = [r["rank"] for r in waited.ranks if r["coords"]["pp"] == 1][0]

    def first_dp_start(report):
        start, _ = report.step_window(-1)
        return min(t["start"] for t in report.transfers[last_stage]
                   if t["group"] == "dp" and t["op"] == "all_reduce" and t["start"] > start)

    def flush(report):  # the end of the last stage's last backward compute
        start, end = report.step_window(-1)
        return max(e.end for e in report.timelines[last_stage]
                   if e.kind == "backward" and start < e.end <= end)

    assert first_dp_start(overlapped) < flush(overlapped)
    assert first_dp_start(waited) >= flush(waited)


def test_zero3_prefetch_books_one_more_gathered_module():
    """The prefetched all-gather writes into a buffer that exists from its launch, so
    prefetch costs at most one more module's full parameters (the largest unit: a
    block), and buys less exposed communication."""
    config = TrainConfig(**TINY, dp=2, zero=3)
    off = train(config.replace(zero3_prefetch=False), device=DEMO_PROFILE)
    on = train(config, device=DEMO_PROFILE)
    d = TINY["d_model"]
    block = (12 * d * d + 13 * d) * 8  # one GPT-2 block's parameters, fp64 (padded: even)
    extra = on.ranks[0]["memory"]["buffers"] - off.ranks[0]["memory"]["buffers"]
    assert 0 < extra <= block
    assert exposed(on) < exposed(off)
    assert on.losses == off.losses
