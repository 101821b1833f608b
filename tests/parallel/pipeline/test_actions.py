"""Pipeline actions and the Schedule: where each chunk sits (the placements), and how the
actions print (PyTorch's schedule IR letters)."""

from __future__ import annotations

from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.split_backward import BackwardInput, BackwardWeight


def test_actions_print_as_pytorch_s_ir_with_the_chunk_after_a_dot():
    assert [str(a) for a in (Forward(3), Backward(3), BackwardInput(3, 1),
                             BackwardWeight(3, 1))] == ["F3", "B3", "I3.1", "W3.1"]
    assert [str(a) for a in (SendActivation(0, 1, 2), RecvActivation(0, 0, 1),
                             SendGrad(2, 0, 0), RecvGrad(2, 0, 1))] == [
        "send act 0.1 -> 2", "recv act 0 <- 1", "send grad 2 -> 0", "recv grad 2 <- 1"]
    assert Forward(0) != Backward(0) and Forward(0, 0) == Forward(0)


def test_the_v_placement_puts_chunk_1_of_rank_r_on_stage_2p_minus_1_minus_r():
    """Qi et al. 2024 (ZB-V) and DualPipe-V: rank 0 holds the first and the last stage."""
    schedule = from_compute_orders("v", 3, 1, 2, [[]] * 3, placement="v")
    assert [[schedule.virtual_stage(r, c) for c in range(2)] for r in range(3)] == [
        [0, 5], [1, 4], [2, 3]]
    assert schedule.rank_of(5) == 0 and schedule.rank_of(3) == 2
