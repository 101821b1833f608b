"""Pipeline schedules as data: the orders of the papers, their bubbles and memory on paper,
and clear errors for schedules that cannot run."""

from __future__ import annotations

import pytest

from minipar.errors import ScheduleError
from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.schedules.interleaved import interleaved_1f1b
from minipar.parallel.pipeline.schedules.one_f_one_b import gpipe, one_f_one_b
from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import in_flight_peak, simulate, validate


def simulated_bubble(schedule, forward_time=1.0, backward_time=2.0):
    """Idle / total rank-time of the schedule run on paper."""
    timeline = simulate(schedule, forward_time, backward_time)
    end = max(e for row in timeline for _, _, e in row)
    busy = sum(e - s for row in timeline for a, s, e in row if isinstance(a, (Forward, Backward)))
    return 1 - busy / (end * len(timeline))


# --------------------------------------------------------------------------- the orders
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


def test_interleaved_order_follows_megatron():
    """p = 2, v = 2, m = 4. Forwards take micro-batches in groups of p through chunk 0, then
    the same group through chunk 1; rank r warms up with 2(p - r - 1) + (v - 1)p forwards
    (4 on rank 0, 2 on rank 1); backwards visit the chunks in reverse."""
    schedule = interleaved_1f1b(pp=2, micro_batches=4, virtual_stages=2)
    assert schedule.compute_order(0) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3")
    assert schedule.compute_order(1) == (
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3")


def test_sends_and_receives_are_in_the_lists_and_printed():
    schedule = one_f_one_b(pp=2, micro_batches=2)
    assert list(schedule[0]) == [
        Forward(0), SendActivation(0, 0, 1),
        Forward(1), SendActivation(1, 0, 1),
        RecvGrad(0, 0, 1), Backward(0),
        RecvGrad(1, 0, 1), Backward(1),
    ]
    assert list(schedule[1]) == [
        RecvActivation(0, 0, 0), Forward(0), Backward(0), SendGrad(0, 0, 0),
        RecvActivation(1, 0, 0), Forward(1), Backward(1), SendGrad(1, 0, 0),
    ]
    text = str(schedule)
    assert "rank 0: F0, send act 0 -> 1" in text
    assert "rank 1: recv act 0 <- 0, F0, B0, send grad 0 -> 0" in text
    chunked = str(interleaved_1f1b(2, 2, 2))
    assert "recv act 0.1 <- 1" in chunked  # rank 0's chunk 1 follows rank 1's chunk 0


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 3, 5, 1),
                                           ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3)])
def test_every_boundary_carries_one_activation_and_one_gradient_per_micro_batch(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    actions = [a for rank in schedule for a in rank]
    boundaries = p * v - 1  # between consecutive virtual stages
    for kind in (SendActivation, RecvActivation, SendGrad, RecvGrad):
        assert sum(isinstance(a, kind) for a in actions) == m * boundaries
    assert sum(isinstance(a, Forward) for a in actions) == m * p * v


# --------------------------------------------------------------------------- bubbles
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    """Narayanan et al. 2021, section 2.2.1: bubble (p - 1)(t_f + t_b) against an ideal
    m (t_f + t_b), for any ratio of backward to forward time."""
    for backward_time in (1.0, 2.0, 3.5):
        bubble = simulated_bubble(make_schedule(name, p, m), 1.0, backward_time)
        assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_bubble_shrinks_by_the_virtual_stages(p, v, groups):
    """Section 2.2.2: with v chunks per rank the bubble is (p - 1)(t_f + t_b)/v against the
    same ideal time, i.e. idle / total = (p - 1) / (v m + p - 1) (times per chunk here)."""
    m = groups * p
    for backward_time in (1.0, 2.0):
        bubble = simulated_bubble(make_schedule("interleaved", p, m, v), 1.0, backward_time)
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


# --------------------------------------------------------------------------- memory
@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (3, 3), (1, 5)])
def test_micro_batches_in_flight_gpipe_m_1f1b_p_minus_stage(p, m):
    for rank in range(p):
        assert in_flight_peak(gpipe(p, m), rank) == m
        assert in_flight_peak(one_f_one_b(p, m), rank) == min(m, p - rank)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name, p, m, v, match", [
    ("interleaved", 4, 6, 2, r"--grad-accum-steps.*multiple of 4.*4 or 8"),
    ("interleaved", 2, 1, 2, r"--grad-accum-steps.*multiple of 2"),
    ("interleaved", 4, 8, 1, r"--virtual-stages.*at least 2"),
    # the fix it suggests would be refused next: it says what else it needs
    ("interleaved", 4, 5, 1, r"--virtual-stages 2 with --grad-accum-steps a multiple of 4"),
    ("interleaved", 1, 4, 2, r"--pp.*at least 2 pipeline ranks"),
    ("1f1b", 4, 8, 2, r"--virtual-stages 2.*--schedule interleaved"),
    ("gpipe", 2, 4, 3, r"--virtual-stages 3"),
    ("zigzag", 2, 4, 1, r"--schedule: unknown.*gpipe, 1f1b, interleaved"),
    ("1f1b", 2, 0, 1, r"micro_batches.*positive integer"),
    ("gpipe", 0, 4, 1, r"pp must be a positive integer"),
])
def test_impossible_settings_are_clear_errors(name, p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        make_schedule(name, p, m, v)


def custom(*ranks, m=1):
    return Schedule("custom", len(ranks), m, 1, tuple(tuple(r) for r in ranks))


def test_validation_names_the_first_broken_rule():
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(B0\): backward before"):
        validate(custom([Backward(0), Forward(0)]))
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(F0\): its input activation"):
        validate(custom([Forward(0), SendActivation(0, 0, 1), RecvGrad(0, 0, 1), Backward(0)],
                        [Forward(0), Backward(0), SendGrad(0, 0, 0)]))
    with pytest.raises(ScheduleError, match=r"neighbour lives on rank 1, not 2"):
        validate(Schedule("custom", 3, 1, 1, ((Forward(0), SendActivation(0, 0, 2)), (), ())))
    with pytest.raises(ScheduleError, match=r"no backward of micro-batch 1"):
        validate(custom([Forward(0), Backward(0), Forward(1)], m=2))
    with pytest.raises(ScheduleError, match=r"not a pipeline action"):
        validate(custom(["F0"]))


def test_a_cycle_of_receives_is_reported_as_a_deadlock():
    # Rank 0 waits for the gradient before sending the activation it depends on.
    schedule = custom(
        [Forward(0), RecvGrad(0, 0, 1), SendActivation(0, 0, 1), Backward(0)],
        [RecvActivation(0, 0, 0), Forward(0), Backward(0), SendGrad(0, 0, 0)],
    )
    with pytest.raises(ScheduleError, match=r"deadlocks.*rank 0 waits at action 1 "
                                            r"\(recv grad 0 <- 1\).*rank 1 waits at action 0"):
        validate(schedule)
