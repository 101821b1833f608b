"""GPipe and 1F1B: the orders of the papers, their bubble and their memory on paper."""

from __future__ import annotations

import pytest

from minipar.parallel.pipeline.schedules.one_f_one_b import gpipe, one_f_one_b
from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import in_flight_peak


def test_gpipe_runs_every_forward_then_every_backward():
    schedule = gpipe(pp=3, micro_batches=4)
    for rank in range(3):
        assert schedule.compute_order(rank) == "F0 F1 F2 F3 B0 B1 B2 B3"


def test_1f1b_order_is_figure_3_of_narayanan_2021():
    """p = 4, m = 8: stage s warms up with p - s - 1 forwards (0-indexed micro-batches)."""
    schedule = one_f_one_b(pp=4, micro_batches=8)
    assert schedule.compute_order(0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert schedule.compute_order(1) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert schedule.compute_order(3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m,
                                                                   simulated_bubble):
    """Narayanan et al. 2021, section 2.2.1: bubble (p - 1)(t_f + t_b) against an ideal
    m (t_f + t_b), for any ratio of backward to forward time."""
    for backward_time in (1.0, 2.0, 3.5):
        bubble = simulated_bubble(make_schedule(name, p, m), 1.0, backward_time)
        assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (3, 3), (1, 5)])
def test_micro_batches_in_flight_gpipe_m_1f1b_p_minus_stage(p, m):
    for rank in range(p):
        assert in_flight_peak(gpipe(p, m), rank) == m
        assert in_flight_peak(one_f_one_b(p, m), rank) == min(m, p - rank)
