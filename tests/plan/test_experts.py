"""The planner's MoE / expert-parallel formulas against what the emulator measured."""

from __future__ import annotations

import pytest

from minipar import distributed as dist
from minipar.plan.experts import (
    MIXTRAL_8X7B,
    MoEShape,
    all_to_all_per_step,
    all_to_all_seconds,
    expert_parameter_bytes,
)
from minipar.train import TrainConfig, train

SMALL = dict(seq_len=8, n_layer=3, n_head=2, d_model=16, micro_batch_size=2, steps=1,
             grad_accum_steps=2, moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.25,
             moe_layer_freq=2, precision="fp64", dp=4)
SHAPE = MoEShape(n_layer=3, d_model=16, num_experts=4, top_k=2, moe_layer_freq=2)
TOKENS = 2 * 8


@pytest.mark.parametrize("ep, gpus_per_node", [(2, 8), (4, 8), (4, 2)])
def test_bytes_and_time_match_the_emulator(ep, gpus_per_node):
    report = train(TrainConfig(**SMALL, ep=ep, gpus_per_node=gpus_per_node))
    moe = report.moe
    assert moe["expert_param_bytes"] == [expert_parameter_bytes(SHAPE, ep, 8)] * 4
    predicted = all_to_all_per_step(SHAPE, TOKENS, 1.25, ep, micro_batches=2, itemsize=8)
    assert moe["all_to_all_sent_bytes"] == [predicted["sent_bytes"]] * 4
    # time: the ep group's slowest link (inside a node, or across with 2 GPUs a node)
    same_node = gpus_per_node >= ep
    alpha, bandwidth = dist.H100.link(same_node)
    seconds = all_to_all_seconds(SHAPE, TOKENS, 1.25, ep, 2, 8, alpha, bandwidth)
    records = report.ranks[0]["comm"]
    assert records["by_op"]["all_to_all"] == predicted["sent_bytes"]
    measured = sum(e.duration for e in report.timelines[0]
                   if e.kind == "comm" and e.label.startswith("all_to_all"))
    assert measured == pytest.approx(seconds, rel=1e-9)


def test_across_nodes_costs_more_than_inside_a_node():
    args = (SHAPE, TOKENS, 1.25, 4, 2, 8)
    inside = all_to_all_seconds(*args, *dist.H100.link(True))
    across = all_to_all_seconds(*args, *dist.H100.link(False))
    assert across > inside


def test_mixtral_8x7b_expert_bytes_fall_as_one_over_ep():
    # 32 layers x 8 experts x 3 x 4096 x 14336 = 45.1e9 expert parameters (of 46.7e9)
    full = expert_parameter_bytes(MIXTRAL_8X7B, 1, 2)
    assert full == 32 * 8 * 3 * 4096 * 14336 * 2
    for ep in (2, 4, 8):
        assert expert_parameter_bytes(MIXTRAL_8X7B, ep, 2) * ep == full
