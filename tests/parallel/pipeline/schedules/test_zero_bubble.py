"""The zero-bubble schedules' orders: ZB-H1 by its rule, ZB-V as PyTorch writes it.
(Their bubbles and activations in flight are checked against their declared facts by
test_registry.py, and measured on real stages by test_executor.py.)"""

from __future__ import annotations

import pytest

from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.schedules.zero_bubble import zb_h1, zb_v


def test_zb_h1_runs_1f1b_s_f_and_i_with_rank_r_s_w_delayed_by_r():
    """Qi et al. 2024, section 3.1: 1F1B's warm-up, F and I in turn, each W of rank r run
    r micro-batches after its I, the rest at the end. p = 2, m = 3."""
    schedule = zb_h1(pp=2, micro_batches=3)
    assert schedule.compute_order(0) == "F0 F1 I0 W0 F2 I1 W1 I2 W2"
    assert schedule.compute_order(1) == "F0 I0 F1 I1 W0 F2 I2 W1 W2"


def test_zb_v_is_pytorch_s_order(in_pytorch_ir):
    """PyTorch 2.13's ScheduleZBVZeroBubble for p = 2, m = 4, as it prints its pipeline
    order (stages 0 and 3 on rank 0, 1 and 2 on rank 1)."""
    schedule = zb_v(pp=2, micro_batches=4)
    assert in_pytorch_ir(schedule, 0) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3")
    assert in_pytorch_ir(schedule, 1) == (
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3")


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 2, 5])
def test_zb_v_is_pytorch_s_for_every_setting(p, extra, in_pytorch_ir, pytorch_order):
    m = 2 * p - 1 + extra  # its fewest micro-batches, and more
    schedule = make_schedule("zb-v", p, m, 2)
    for rank in range(p):
        assert in_pytorch_ir(schedule, rank) == pytorch_order("ScheduleZBVZeroBubble", p, m,
                                                              2, rank)
