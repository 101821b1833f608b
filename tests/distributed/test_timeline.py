"""Busy, idle and exposed time read from the simulated clocks' timelines (timeline.py)."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.distributed.timeline import (
    bubble_fraction,
    communication_bound,
    communication_share,
    time_breakdown,
)

PROFILE = dist.DeviceProfile(flops=1e12, intra_node_latency=0.0)


def test_exposed_communication_is_communication_while_not_computing():
    # compute [0, 4] and [6, 10]; transfers [3, 7] and [9, 12] (seconds).
    got = dist.comm_overlap([(0, 4), (6, 10)], [(3, 7), (9, 12)])
    # communication: 4 + 3 = 7; under compute: [3, 4] + [6, 7] + [9, 10] = 3; so 4 exposed
    assert got == {"compute_s": 8, "comm_s": 7, "overlapped_comm_s": 3,
                   "exposed_comm_s": 4, "busy_s": 12}


def test_overlapping_spans_are_counted_once():
    assert dist.comm_overlap([], [(0, 2), (1, 3)])["exposed_comm_s"] == 3


@pytest.mark.parametrize("async_op", [False, True])
def test_an_async_collective_behind_compute_exposes_nothing(async_op):
    """An all-reduce posted before 1 s of compute that takes less than that hides
    entirely; waited at once, all of its ring time is exposed (and is comm_s)."""
    def worker():
        device = dist.get_device()
        work = dist.all_reduce(np.zeros(1000), async_op=True)
        if not async_op:
            work.wait()
        device.compute(1e12, "backward")  # 1 s on this profile
        if async_op:
            work.wait()
        return dist.device_comm_overlap(device), device.clock.comm_s

    (overlap, comm_s), _ = dist.launch(worker, 2, device=PROFILE)
    ring = 2 * (2 - 1) / 2 * 8000 / PROFILE.intra_node_bandwidth
    assert overlap["comm_s"] == pytest.approx(ring)
    if async_op:
        assert overlap["exposed_comm_s"] == 0 and comm_s == 0
    else:
        assert overlap["exposed_comm_s"] == pytest.approx(ring) == comm_s


# ------------------------------------------------------------------ idle and communication-bound
def events(*spans):
    return [{"kind": kind, "start": start, "end": end} for kind, start, end in spans]


def test_idle_is_what_no_event_covers_up_to_the_last_rank():
    timelines = [events(("forward", 0, 2), ("comm", 2, 3)), events(("forward", 1, 2))]
    assert time_breakdown(timelines) == [
        {"compute_s": 2, "comm_s": 1, "idle_s": 0},
        {"compute_s": 1, "comm_s": 0, "idle_s": 2}]
    assert bubble_fraction(timelines) == 2 / 6


def test_a_run_is_communication_bound_when_messages_take_longer_than_compute():
    compute_bound = [events(("forward", 0, 3), ("comm", 3, 4))]
    latency_bound = [events(("forward", 0, 1), ("comm", 1, 4))]
    assert communication_share(compute_bound) == 0.25
    assert communication_share(latency_bound) == 0.75
    assert not communication_bound(compute_bound)
    assert communication_bound(latency_bound)
    assert communication_share([]) == 0.0
