"""The schedule simulator with costs (simulate_step, which the planner's exact pipeline
time calls): the closed forms with free communication, the schedules' own ideal timings,
and a hand-traced latency-bound case."""

from __future__ import annotations

import dataclasses

import pytest

from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import simulate, simulate_step


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
