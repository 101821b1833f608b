"""From compute orders to action lists: a receive before each compute that needs one and
a send after each one that made it, one of each per micro-batch and boundary; printed as
they are listed."""

from __future__ import annotations

import pytest

from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.schedules.interleaved import interleaved_1f1b
from minipar.parallel.pipeline.schedules.one_f_one_b import one_f_one_b
from minipar.parallel.pipeline.schedules.registry import make_schedule


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

