"""The engine charges a backward pass to the "backward" phase of the current device (the
device protocol of tracking.py), so a hook's communication needs no phase context."""

from __future__ import annotations

import numpy as np

from minipar.autograd import Tensor
from minipar.autograd.tracking import use_device


class PhaseDevice:
    """A device that only has what the engine reads: compute, memory, phase."""

    class Memory:
        def hold(self, array, category):
            pass

        def release(self, array):
            pass

    def __init__(self):
        self.memory = self.Memory()
        self.phase = "forward"

    def compute(self, flops, kind):
        pass


def test_backward_runs_in_the_backward_phase_and_restores_the_previous_one():
    device = PhaseDevice()
    seen = []
    with use_device(device):
        w = Tensor(np.ones(3), requires_grad=True)
        w.register_post_accumulate_grad_hook(lambda leaf: seen.append(device.phase))
        loss = (w * w).sum()
        assert device.phase == "forward"
        loss.backward()
    assert seen == ["backward"]  # where DDP / ZeRO start their reductions
    assert device.phase == "forward"


def test_a_device_without_a_phase_still_counts_backward():
    class Counting(PhaseDevice):
        def __init__(self):
            super().__init__()
            del self.phase
            self.flops = 0

        def compute(self, flops, kind):
            self.flops += flops

    device = Counting()
    with use_device(device):
        w = Tensor(np.ones(3), requires_grad=True)
        (w * w).sum().backward()
    assert device.flops > 0 and not hasattr(device, "phase")
