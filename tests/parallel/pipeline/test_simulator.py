"""The schedule simulator (simulate_step, which validates every schedule and which the
planner's exact pipeline time calls): the closed forms with free communication, the
schedules' own ideal timings, a hand-traced latency-bound case, a V checked by its
placement, and the first broken rule named."""

from __future__ import annotations

import dataclasses

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
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import simulate, simulate_step, validate


def simulate_schedule(name, pp, micro_batches, virtual_stages, forward, backward, message):
    """Schedule `name` run with per-(rank, chunk) costs, as a dict of per-rank lists."""
    run = simulate_step(make_schedule(name, pp, micro_batches, virtual_stages), forward,
                        backward, message)
    return dataclasses.asdict(run)


def uniform(p, v, cost):
    return [[cost] * v for _ in range(p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_free_communication_gives_m_plus_p_minus_one_slots(schedule, p, m):
    # Narayanan et al. 2021, section 2.2.1: (m + p - 1)(t_f + t_b)
    run = simulate_schedule(schedule, p, m, 1, uniform(p, 1, 1.0), uniform(p, 1, 2.0), 0.0)
    assert max(run["finish"]) == pytest.approx((m + p - 1) * 3.0)
    idle = sum(run["idle"]) + sum(max(run["finish"]) - f for f in run["finish"])
    assert idle / (p * max(run["finish"])) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (2, 6, 3)])
def test_interleaved_matches_the_schedules_ideal_timeline(p, m, v):
    ideal = simulate(make_schedule("interleaved", p, m, v), 1.0, 2.0)
    expected = max(end for rank in ideal for _, _, end in rank)
    run = simulate_schedule("interleaved", p, m, v, uniform(p, v, 1.0), uniform(p, v, 2.0),
                            0.0)
    assert max(run["finish"]) == pytest.approx(expected)


def test_latency_bound_1f1b_traced_by_hand():
    # p = 2, m = 4, no compute, every message takes c = 1 from the moment both sides
    # have posted. Rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, rank 1 F0 B0 F1 B1 ... B3:
    # act0 arrives at 1; rank 1 posts recv act1 at 1 -> 2; grad0 reaches rank 0 at 2,
    # act2 (sent at 2) reaches rank 1 at 3, ... the last gradient lands at 5.
    run = simulate_schedule("1f1b", 2, 4, 1, uniform(2, 1, 0.0), uniform(2, 1, 0.0), 1.0)
    assert run["finish"] == [5.0, 5.0]
    assert run["comm"] == [4.0, 4.0]


def test_the_simulator_checks_a_v_shaped_schedule_by_its_placement():
    """One micro-batch down ranks 0, 1 (chunk 0) and back up 1, 0 (chunk 1): the message
    from stage 1 to stage 2 stays on rank 1 (handed over in memory, no message: a real
    p2p library does not send to itself), and the loss is on rank 0."""
    orders = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)],
              [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]]
    schedule = from_compute_orders("v-gpipe", 2, 1, 2, orders, placement="v")
    assert schedule[0][:4] == (Forward(0), SendActivation(0, 0, 1),
                               RecvActivation(0, 1, 1), Forward(0, 1))
    assert schedule[1][:3] == (RecvActivation(0, 0, 0), Forward(0), Forward(0, 1))
    run = simulate_step(schedule, 1.0, 2.0)
    assert max(run.finish) == pytest.approx(4 * 1.0 + 4 * 2.0)  # a chain of 4 stages
    wrong = list(schedule[0])
    wrong[wrong.index(RecvGrad(0, 0, 1))] = RecvGrad(0, 0, 0)
    with pytest.raises(ScheduleError, match="virtual stage 0's neighbour lives on rank 1"):
        validate(Schedule("v-gpipe", 2, 1, 2, (tuple(wrong), schedule[1]), "v"))
    assert SendGrad(0, 1, 1) in schedule[0]


def test_the_simulator_s_time_is_compute_plus_comm_plus_idle_on_every_rank():
    """p = 2, v = 2, m = 4 with uneven per-(rank, chunk) costs: each rank holds two of the
    four stages, which touch all three boundaries, so it receives 3 x 4 messages."""
    forward, backward = [[1.0, 1.5], [0.5, 2.0]], [[2.0, 3.0], [1.0, 4.0]]
    run = simulate_step(make_schedule("interleaved", 2, 4, 2), forward, backward, 0.25)
    for r in range(2):
        assert run.compute[r] == pytest.approx(4 * (sum(forward[r]) + sum(backward[r])))
        assert run.comm[r] == pytest.approx(12 * 0.25)
        assert run.compute[r] + run.comm[r] + run.idle[r] == pytest.approx(run.finish[r])


def test_a_message_can_cost_what_its_hop_costs():
    """message(sender, receiver): p = 4 GPipe, m = 2, where only the hop between ranks 1
    and 2 costs (it crosses nodes, say): each rank pays it for the messages it receives
    over that hop, 2 activations (rank 2) or 2 gradients (rank 1), nothing else."""
    def message(sender, receiver):
        return 1.0 if {sender, receiver} == {1, 2} else 0.0

    run = simulate_step(make_schedule("gpipe", 4, 2, 1), 0.0, 0.0, message)
    assert run.comm == [0.0, 2.0, 2.0, 0.0]
    same = simulate_step(make_schedule("gpipe", 4, 2, 1), 0.0, 0.0, 1.0)
    assert same.comm == [2.0, 4.0, 4.0, 2.0]  # (one number: every hop alike)


def test_a_hold_delays_the_rank_and_what_it_sends_next():
    """hold={(rank, i): seconds}: the rank waits after its i-th action (ZeRO-1's limit
    of reductions in flight stalling a backward, say), booked as communication. 1F1B,
    p = m = 2, forward 1 s, backward 2 s: rank 1 held 0.5 s after its first backward
    sends that gradient 0.5 s later, so rank 0 receives it and ends 0.5 s later too."""
    schedule = make_schedule("1f1b", 2, 2, 1)
    free = simulate_step(schedule, 1.0, 2.0, 0.0)
    held = simulate_step(schedule, 1.0, 2.0, 0.0, hold={(1, 2): 0.5})
    assert [type(action) for action, _, _ in held.timelines[1][2:4]] == [Backward, SendGrad]
    assert held.timelines[1][3][1] == free.timelines[1][3][1] + 0.5
    assert held.finish == [free.finish[0] + 0.5, free.finish[1] + 0.5]
    assert held.comm == [0.0, 0.5] and held.idle[0] == free.idle[0] + 0.5
    for r in range(2):
        assert held.compute[r] + held.comm[r] + held.idle[r] == pytest.approx(held.finish[r])


# --------------------------------------------------------------------------- the rules
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
