"""DualPipe-V's order: DeepSeek's DualPipeV steps, as PyTorch's ScheduleDualPipeV writes
them (an overlapped forward-backward pair printed as its forward, then its backward)."""

from __future__ import annotations

import pytest

from minipar.parallel.pipeline.schedules.dualpipe import dualpipe_v
from minipar.parallel.pipeline.schedules.registry import make_schedule


def test_dualpipe_v_is_pytorch_s_order(in_pytorch_ir):
    """PyTorch 2.13's ScheduleDualPipeV for p = 2, m = 4: step 4's F&B pairs run full
    backwards (B), the zero-bubble steps split them in I and W."""
    schedule = dualpipe_v(pp=2, micro_batches=4)
    assert in_pytorch_ir(schedule, 0) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3")
    assert in_pytorch_ir(schedule, 1) == (
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3")


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 2, 5])
def test_dualpipe_v_is_pytorch_s_for_every_setting(p, extra, in_pytorch_ir, pytorch_order):
    m = 2 * p + extra  # its fewest micro-batches (DualPipeV's own assertion), and more
    schedule = make_schedule("dualpipe-v", p, m, 2)
    for rank in range(p):
        assert in_pytorch_ir(schedule, rank) == pytorch_order("ScheduleDualPipeV", p, m, 2,
                                                              rank)
