"""One pipeline rank's training step: its schedule's actions run over the micro-batches.

`pipe.actions` is this rank's list (1F1B's: schedules/one_f_one_b.py; the vocabulary:
actions.py) and `pipe.chunks[c]` the GPT over virtual stage `pipe.stages[c]`'s layers
(stage.py). A forward receives its (b, s, h) input from the stage before and sends its
output on; a backward receives the gradient of that output and sends its input's back
(Megatron-LM, megatron/core/pipeline_parallel/schedules.py). Sends are `isend`s, waited
for at the end: a blocking send is a rendezvous (as with NCCL), so two neighbours that
both send first would deadlock. A receive blocks until its message is there: the bubble.
The last stage backpropagates each loss scaled by 1/m: the gradients of the step's mean
loss, as in single-device gradient accumulation.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.errors import PipelineError
from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.stage import StageInput


def forward_backward(pipe, micro_batches, grad_sync=None) -> float:
    """Run this rank's actions over one step's m (inputs, targets); return the mean loss
    on every rank. grad_sync(enabled), if given, is called before every action that adds
    into the weight gradients, enabled for each chunk's last micro-batch (Megatron-LM's
    --overlap-grad-reduce: DP reduces the chunk's buckets while the pipeline drains)."""
    step = pipe.runtime(pipe, micro_batches)  # Step below; split_backward.py for I and W
    # each chunk's last backward: one action, or a split backward's I and W
    last = {a.chunk: a.micro_batch for a in pipe.actions if type(a) in step.weight_actions}
    for action in pipe.actions:
        if grad_sync is not None and type(action) in step.weight_actions:
            grad_sync(action.micro_batch == last[action.chunk])
        step.run(action)
    step.finish_sends()
    pipe.tied.all_reduce_grads()  # the two stages' copies of wte (tied_embedding.py)
    last_rank = pipe.schedule.rank_of(pipe.pp * pipe.virtual_stages - 1)
    mean = np.asarray(np.mean(step.losses) if pipe.pp_rank == last_rank else 0.0, np.float64)
    with dist.phase("other"):
        return float(dist.broadcast(mean, src=pipe.group.ranks[last_rank], group=pipe.group))


class Step:
    """One forward_backward on one rank; keys are (micro_batch, chunk). Received
    activations and gradients are "buffers" until the backward that consumes them."""

    weight_actions: tuple = (Backward,)  # the actions that add into the weight gradients

    def __init__(self, pipe, micro_batches):
        self.pipe, self.batches = pipe, micro_batches
        self.inputs: dict = {}  # -> the chunk's input: received, or the first stage's embedding
        self.outputs: dict = {}  # -> the chunk's output (the last stage's: the loss)
        self.out_grads: dict = {}  # -> the received gradient of the output
        self.losses = [None] * pipe.micro_batches
        self.sends = {"forward": [], "backward": []}
        self.handlers = {Forward: self.forward, Backward: self.backward,
                         RecvActivation: self.recv_activation, SendActivation: self.send_activation,
                         RecvGrad: self.recv_grad, SendGrad: self.send_grad}

    def run(self, action) -> None:
        if type(action) not in self.handlers:
            raise PipelineError(f"not a pipeline action: {action!r}")
        self.handlers[type(action)](action)

    def forward(self, action) -> None:
        key, chunk = (action.micro_batch, action.chunk), self.pipe.chunks[action.chunk]
        inputs, targets = self.batches[action.micro_batch]
        # (copies: this micro-batch's tokens moved to the device, as a data loader does)
        targets = np.array(targets, copy=True) if chunk.post_process else None
        with dist.phase("forward"), dist.timeline_label(str(action)):
            if chunk.pre_process:
                self.inputs[key] = chunk.embed(np.array(inputs, copy=True))
            out = chunk.body(self.inputs[key], targets)
        self.outputs[key] = out
        if chunk.post_process:
            self.losses[action.micro_batch] = float(out.data)

    def backward(self, action) -> None:
        key, chunk = (action.micro_batch, action.chunk), self.pipe.chunks[action.chunk]
        out = self.outputs.pop(key)
        # d(mean over the m micro-batches)/d(loss_i) = 1/m
        grad = (np.asarray(1.0 / self.pipe.micro_batches, dtype=out.data.dtype)
                if chunk.post_process else self.out_grads.pop(key))
        with dist.timeline_label(str(action)):  # (autograd books it under "backward")
            self.backpropagate(action, out, grad)
        if not chunk.post_process:
            dist.release(grad)
        if chunk.pre_process:  # (a received input goes when its gradient is sent)
            del self.inputs[key]

    def backpropagate(self, action, out, grad) -> None:
        out.backward(grad)

    # Messages: stage s's output goes to stage s + 1, and its gradient comes back.
    def recv_activation(self, action) -> None:
        with dist.phase("forward"):
            data = dist.recv(*self.route(action), category="buffers")
        self.inputs[action.micro_batch, action.chunk] = StageInput(data, requires_grad=True)

    def send_activation(self, action) -> None:
        out = self.outputs[action.micro_batch, action.chunk]
        self.sends["forward"].append(dist.isend(out.data, *self.route(action)))

    def recv_grad(self, action) -> None:
        with dist.phase("backward"):
            grad = dist.recv(*self.route(action), category="buffers")
        self.out_grads[action.micro_batch, action.chunk] = grad

    def send_grad(self, action) -> None:
        x = self.inputs.pop((action.micro_batch, action.chunk))
        self.sends["backward"].append(dist.isend(x.grad, *self.route(action)))
        x.release_grad()
        dist.release(x.data)

    def route(self, message) -> tuple:
        """(peer's rank, group, tag): a tag per micro-batch, boundary and direction, so
        every receive matches exactly its send."""
        stage = self.pipe.stages[message.chunk]
        boundary = stage if type(message) in (SendActivation, RecvGrad) else stage - 1
        gradient = type(message) in (SendGrad, RecvGrad)
        tag = (message.micro_batch * self.pipe.pp * self.pipe.virtual_stages + boundary) * 2
        return self.pipe.group.ranks[message.peer], self.pipe.group, tag + gradient

    def finish_sends(self) -> None:
        """Wait for the step's sends (their bytes are booked under their phase)."""
        for phase, works in self.sends.items():
            with dist.phase(phase):
                for work in works:
                    work.wait()
