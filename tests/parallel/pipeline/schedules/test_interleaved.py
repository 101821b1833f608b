"""Interleaved 1F1B: Megatron-LM's order (PyTorch's too where they agree), and the bubble
shrunk by the chunks per rank."""

from __future__ import annotations

import pytest

from minipar.parallel.pipeline.schedules.interleaved import interleaved_1f1b
from minipar.parallel.pipeline.schedules.registry import make_schedule


def test_interleaved_order_follows_megatron():
    """p = 2, v = 2, m = 4. Forwards take micro-batches in groups of p through chunk 0, then
    the same group through chunk 1; rank r warms up with 2(p - r - 1) + (v - 1)p forwards
    (4 on rank 0, 2 on rank 1); backwards visit the chunks in reverse."""
    schedule = interleaved_1f1b(pp=2, micro_batches=4, virtual_stages=2)
    assert schedule.compute_order(0) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3")
    assert schedule.compute_order(1) == (
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3")


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [2, 3])
def test_interleaved_is_pytorch_s_when_there_are_several_groups(p, v, groups, in_pytorch_ir,
                                                                 pytorch_order):
    """PyTorch's ScheduleInterleaved1F1B has Megatron's warm-up when m is a multiple of p
    above p. (With m = p Megatron runs every forward first; PyTorch keeps the warm-up.)"""
    m = groups * p
    schedule = make_schedule("interleaved", p, m, v)
    for rank in range(p):
        assert in_pytorch_ir(schedule, rank) == pytorch_order("ScheduleInterleaved1F1B", p,
                                                              m, v, rank)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_bubble_shrinks_by_the_virtual_stages(p, v, groups, simulated_bubble):
    """Section 2.2.2: with v chunks per rank the bubble is (p - 1)(t_f + t_b)/v against the
    same ideal time, i.e. idle / total = (p - 1) / (v m + p - 1) (times per chunk here)."""
    m = groups * p
    for backward_time in (1.0, 2.0):
        bubble = simulated_bubble(make_schedule("interleaved", p, m, v), 1.0, backward_time)
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
