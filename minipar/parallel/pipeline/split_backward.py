"""What the zero-bubble schedules add to the step: the split backward and the V's hand-off.

ZB-H1, ZB-H2, ZB-V (Qi et al. 2024) and DualPipe-V run a backward in two halves, two
actions printed as in PyTorch's schedule IR:
    BackwardInput(i, c)   I3: as far as the chunk's input only, whose gradient the
                          previous stage waits for (the paper's "B")
    BackwardWeight(i, c)  W3: the weight gradients I left queued (the paper's "W"),
                          run later, in a bubble
(minipar.autograd.engine.backward_input, as PyTorch's `stage_backward_input` and
`stage_backward_weight`, torch/distributed/pipelining/_backward.py). The V placements
of ZB-V and DualPipe-V also put two neighbouring virtual stages on one rank (the V's
tip; the first and the last stage on rank 0): the activation and its gradient pass
between them in memory, with no message and no action.

`runtime_for(schedule)` picks `SplitBackwardStep` for a schedule that needs either, and
executor.py's `Step` for the others.
"""

from __future__ import annotations

from minipar import distributed as dist
from minipar.autograd.engine import backward_input
from minipar.parallel.pipeline.actions import Backward, Compute, Schedule
from minipar.parallel.pipeline.executor import Step
from minipar.parallel.pipeline.stage import StageInput


class BackwardInput(Compute):
    letter = "I"


class BackwardWeight(Compute):
    letter = "W"


class SplitBackwardStep(Step):
    """executor.Step with I and W, and tensors handed over between my neighbouring stages."""

    # an I adds into weight gradients too when it holds a checkpointed layer, whose
    # recomputed backward makes them all at once (autograd/checkpoint.py)
    weight_actions = (Backward, BackwardInput, BackwardWeight)

    def __init__(self, pipe, micro_batches):
        super().__init__(pipe, micro_batches)
        self.weight_work: dict = {}  # (micro_batch, chunk) -> the W an I left queued
        self.chunk_of = {stage: c for c, stage in enumerate(pipe.stages)}
        self.handlers.update({BackwardInput: self.backward, BackwardWeight: self.weight})

    def backpropagate(self, action, out, grad) -> None:
        if type(action) is BackwardInput:  # I: stop at the chunk's input, queue W
            key = (action.micro_batch, action.chunk)
            self.weight_work[key] = backward_input(out, grad, [self.inputs[key]])
        else:
            super().backpropagate(action, out, grad)

    def weight(self, action) -> None:
        with dist.timeline_label(str(action)):
            self.weight_work.pop((action.micro_batch, action.chunk)).run()

    def local(self, stage: int) -> bool:
        """Does this rank hold virtual stage `stage` (tensors then pass in memory)?"""
        return self.pipe.schedule.rank_of(stage) == self.pipe.pp_rank

    def forward(self, action) -> None:
        super().forward(action)
        chunk, stage = self.pipe.chunks[action.chunk], self.pipe.stages[action.chunk]
        if not chunk.post_process and self.local(stage + 1):  # hand the activation over
            out = self.outputs[action.micro_batch, action.chunk]
            following = (action.micro_batch, self.chunk_of[stage + 1])
            self.inputs[following] = StageInput(out.data, requires_grad=True)

    def backward(self, action) -> None:  # B, or I
        super().backward(action)
        chunk, stage = self.pipe.chunks[action.chunk], self.pipe.stages[action.chunk]
        if not chunk.pre_process and self.local(stage - 1):  # hand the gradient over
            x = self.inputs.pop((action.micro_batch, action.chunk))
            self.out_grads[(action.micro_batch, self.chunk_of[stage - 1])] = x.grad
            dist.hold(x.grad, "buffers")  # until the stage before has used it
            x.release_grad()


def runtime_for(schedule: Schedule) -> type[Step]:
    """SplitBackwardStep if `schedule` splits a backward or puts two neighbouring virtual
    stages on one rank; else Step."""
    split = any(type(a) in (BackwardInput, BackwardWeight) for rank in schedule for a in rank)
    last = schedule.pp * schedule.virtual_stages - 1
    tip = any(schedule.rank_of(s) == schedule.rank_of(s + 1) for s in range(last))
    return SplitBackwardStep if split or tip else Step
