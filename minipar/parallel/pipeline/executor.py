"""Pipeline parallelism: the model cut into stages of consecutive layers, one per rank.

    pipe = Pipeline(gpt_config, pp_group=mesh.pp_group(), schedule="1f1b", micro_batches=8)
    optimizer = AdamW(pipe.named_parameters())
    loss = pipe.forward_backward(micro_batches)   # [(inputs, targets), ...] of one step
    optimizer.step(); optimizer.zero_grad()

Each chunk is a GPT over its layers (stage.py). One step, from one rank's point of view:
run the schedule's actions in order (schedules/). A forward receives the (b, s, h)
activation from the previous stage, runs the chunk and sends its output on; a backward
receives the gradient of that output, backpropagates and sends the gradient of its input
back. Sends are `isend`s (a blocking send is a rendezvous, as with NCCL, so two
neighbours that both send first would deadlock), waited for at the end of the step; a
receive blocks until its message is there, which is where the pipeline bubble shows up
on the simulated clock (`bubble_fraction` in minipar/distributed/timeline.py).

Loss: the last stage backpropagates each micro-batch's mean cross-entropy scaled by 1/m,
so the gradients are those of the step's mean loss, as in single-device gradient
accumulation; it broadcasts that mean over the pp group (8 bytes per step).

Memory: received activations and gradients are "buffers" from their arrival until the
backward that consumes them; what the chunks save for backward is "activations".
Micro-batch tokens are copied when their forward runs, as a data loader moves each
micro-batch to the GPU.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.engine import backward_input
from minipar.errors import PipelineError
from minipar.nn import GPT, GPTConfig
from minipar.nn.optim import grad_norm_squared
from minipar.nn.recompute import Recompute
from minipar.parallel.pipeline.actions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import validate
from minipar.parallel.pipeline.stage import StageInput, split_layers, stage_part
from minipar.parallel.pipeline.tied_embedding import TiedEmbedding


# --------------------------------------------------------------------------- one rank
class Pipeline:
    """One pipeline rank's model chunks, its schedule and the group it talks to.

    config: the GPT shape; pp_group: this rank's pipeline group (`mesh.pp_group()`; None =
    every rank of the launch); schedule: a name in schedules/registry.py or a Schedule;
    micro_batches: m per optimizer step (= grad_accum_steps); virtual_stages: model chunks
    per rank (interleaved); layer_split: layers per virtual stage (default balanced);
    validate_schedule: check a given Schedule before running it (leave on);
    build_chunk(**part) -> GPT: builds one chunk from GPT's part keywords
    (`stage_part`: layers, pre_process, post_process, stage), e.g. a GPT then converted
    by tensor and context parallelism (minipar/train/build.py); by default a plain
    `GPT(config, seed, precision, recompute, **part)`.
    Build it inside `minipar.distributed.launch`; every rank of the group builds its own share.
    """

    def __init__(self, config: GPTConfig, *, pp_group: dist.ProcessGroup | None = None,
                 schedule: str | Schedule = "1f1b", micro_batches: int = 1,
                 virtual_stages: int = 1, layer_split=None, seed: int = 0,
                 precision: str = "fp64", recompute: Recompute | None = None,
                 validate_schedule: bool = True, build_chunk=None):
        if build_chunk is None:
            def build_chunk(**part) -> GPT:
                return GPT(config, seed, precision, recompute, **part)
        if pp_group is None:
            pp_group = dist.new_group(range(dist.get_world_size()), kind="pp")
        self.config, self.group = config, pp_group
        self.pp, self.pp_rank = pp_group.size, pp_group.group_rank(dist.get_rank())
        if isinstance(schedule, Schedule):
            if validate_schedule:
                validate(schedule)
            virtual_stages = schedule.virtual_stages
            if (schedule.pp, schedule.micro_batches) != (self.pp, micro_batches):
                raise PipelineError(
                    f"the {schedule.name} schedule is for pp={schedule.pp}, "
                    f"micro_batches={schedule.micro_batches} but this pipeline has "
                    f"pp={self.pp}, micro_batches={micro_batches}")
        else:
            schedule = make_schedule(schedule, self.pp, micro_batches, virtual_stages)
        self.schedule = schedule
        self.actions = schedule[self.pp_rank]
        self.micro_batches, self.virtual_stages = micro_batches, virtual_stages
        self._counted_in_norm = None  # ids of counts_in_norm's parameters, once asked
        num_stages = self.pp * virtual_stages
        ranges = split_layers(config.n_layer, num_stages, layer_split)
        # the virtual stage of each of my chunks
        self.stages = [schedule.virtual_stage(self.pp_rank, c) for c in range(virtual_stages)]
        self.chunks = [build_chunk(**stage_part(stage, num_stages, ranges[stage]))
                       for stage in self.stages]
        self.tied = TiedEmbedding(config, pp_group, schedule, self.pp_rank, self.chunks)

    # ------------------------------------------------------------------ parameters
    def named_parameters(self, include_tied_copy: bool = True):
        """(global HF name, Parameter) of every chunk on this rank."""
        seen = set() if include_tied_copy else {id(p) for p in self.tied.copies()}
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self, include_tied_copy: bool = True):
        return [p for _, p in self.named_parameters(include_tied_copy)]

    def state_dict(self) -> dict[str, np.ndarray]:
        """This rank's parameters by global name, without the tied copy of wte (the first
        stage's is the same): the union over the pp group is the single-device dict."""
        return {name: p.data.copy() for name, p in self.named_parameters(False)}

    def counts_in_norm(self, param) -> bool:
        """Does my `param` count in the global gradient norm? Every parameter once: not
        the last stage's tied copy of wte (equal to the first stage's after the step)."""
        if self._counted_in_norm is None:  # the chunks' parameters are fixed once built
            self._counted_in_norm = frozenset(map(id, self.parameters(include_tied_copy=False)))
        return id(param) in self._counted_in_norm

    def grad_norm_squared(self) -> float:
        """Sum of squared gradients of the parameters that `counts_in_norm`, on this rank.
        Sum it over the pp group for the squared global norm."""
        return grad_norm_squared(p.grad for p in self.parameters()
                                 if p.grad is not None and self.counts_in_norm(p))

    def late_reduced_parameters(self) -> list:
        """Parameters whose gradient is final only after the whole schedule (the tied
        embedding's, `TiedEmbedding.late_reduced`): a DP engine reduces them in
        synchronize_gradients, not from its hooks."""
        return self.tied.late_reduced()

    # ------------------------------------------------------------------ one step
    def forward_backward(self, micro_batches, grad_sync=None) -> float:
        """Run this rank's schedule over one step's micro-batches; return the step's loss.

        micro_batches: m pairs (inputs, targets), each (b, T) ints. Only the first stage
        reads inputs and only the last reads targets: other ranks may pass None for them.
        Afterwards every parameter's .grad holds d(mean loss over the m micro-batches)/dp,
        the tied embedding copies agree, and the mean loss is returned on every rank.
        grad_sync(enabled): called before every backward (B, or W of a split one),
        enabled only for each chunk's last one, when its gradients become final
        (Megatron-LM's `--overlap-grad-reduce`: the schedule calls `enable_grad_sync()`
        before the last micro-batch, so the DP engine's hooks start reducing buckets
        while the pipeline drains).
        """
        m = self.micro_batches
        if len(micro_batches) != m:
            raise PipelineError(
                f"forward_backward got {len(micro_batches)} micro-batches but the "
                f"{self.schedule.name} schedule was built for {m} (grad_accum_steps)")
        # the actions that add into the weight gradients: B, or W after a split I
        weights = (Backward, BackwardWeight)
        last_backward = {a.chunk: i for i, a in enumerate(self.actions)
                         if type(a) in weights}
        step = _Step(self, micro_batches)
        for i, action in enumerate(self.actions):
            if grad_sync is not None and type(action) in weights:
                grad_sync(last_backward[action.chunk] == i)
            step.run(action)
        step.finish_sends()
        self.tied.all_reduce_grads()
        return self._broadcast_loss(step.losses)

    def _broadcast_loss(self, losses) -> float:
        """The step's mean loss, from the rank holding the last stage to every rank."""
        last_rank = self.schedule.rank_of(self.pp * self.virtual_stages - 1)
        mean = np.asarray(np.mean(losses) if self.pp_rank == last_rank else 0.0, np.float64)
        with dist.phase("other"):
            return float(dist.broadcast(mean, src=self.group.ranks[last_rank],
                                        group=self.group))


class _Step:
    """The state of one forward_backward: tensors waiting for their backward, messages."""

    def __init__(self, pipe: Pipeline, micro_batches):
        self.pipe = pipe
        self.batches = micro_batches
        self.inputs: dict = {}  # (micro_batch, chunk) -> StageInput received
        self.outputs: dict = {}  # (micro_batch, chunk) -> output Tensor (or the loss)
        self.out_grads: dict = {}  # (micro_batch, chunk) -> received gradient of the output
        self.embedded: dict = {}  # (micro_batch, 0) -> the first stage's embedding output
        self.weight_work: dict = {}  # (micro_batch, chunk) -> the W an I left queued
        self.chunk_of = {stage: c for c, stage in enumerate(pipe.stages)}
        self.losses = [None] * pipe.micro_batches
        self.sends = {"forward": [], "backward": []}
        self.scale = 1.0 / pipe.micro_batches
        self.num_stages = pipe.pp * pipe.virtual_stages

    def tag(self, kind: int, micro_batch: int, boundary: int) -> int:
        """A tag per message (activation: kind 0; gradient: 1), so every receive matches
        exactly its send whatever order a custom schedule posts them in."""
        return (micro_batch * self.num_stages + boundary) * 2 + kind

    def peer(self, action) -> int:
        return self.pipe.group.ranks[action.peer]

    def run(self, action) -> None:
        key = (action.micro_batch, action.chunk)
        chunk = self.pipe.chunks[action.chunk]
        stage = self.pipe.stages[action.chunk]
        kind = type(action)
        if kind is Forward:
            self.forward(key, chunk, stage, action)
        elif kind is Backward or kind is BackwardInput:
            self.backward(key, chunk, stage, action, split=kind is BackwardInput)
        elif kind is BackwardWeight:
            with dist.timeline_label(str(action)):
                self.weight_work.pop(key).run()
        elif kind is RecvActivation:
            with dist.phase("forward"):
                data = dist.recv(self.peer(action), self.pipe.group,
                                 self.tag(0, key[0], stage - 1), category="buffers")
            self.inputs[key] = StageInput(data, requires_grad=True)
        elif kind is SendActivation:
            self.sends["forward"].append(dist.isend(
                self.outputs[key].data, self.peer(action), self.pipe.group,
                self.tag(0, key[0], stage)))
        elif kind is RecvGrad:
            with dist.phase("backward"):
                grad = dist.recv(self.peer(action), self.pipe.group,
                                 self.tag(1, key[0], stage), category="buffers")
            self.out_grads[key] = grad
        elif kind is SendGrad:
            x = self.inputs.pop(key)
            self.sends["backward"].append(dist.isend(
                x.grad, self.peer(action), self.pipe.group, self.tag(1, key[0], stage - 1)))
            x.release_grad()
            dist.release(x.data)
        else:
            raise PipelineError(f"not a pipeline action: {action!r}")

    def forward(self, key, chunk: GPT, stage: int, action) -> None:
        inputs, targets = self.batches[key[0]]
        if chunk.pre_process:
            if inputs is None:
                raise PipelineError("the first pipeline stage needs the micro-batch inputs")
            x = np.array(inputs, copy=True)  # this micro-batch's tokens, on the device
        else:
            x = self.inputs[key]
        if chunk.post_process:
            if targets is None:
                raise PipelineError("the last pipeline stage needs the micro-batch targets")
            targets = np.array(targets, copy=True)
        with dist.phase("forward"), dist.timeline_label(str(action)):
            if chunk.pre_process:
                x = self.embedded[key] = chunk.embed(x)
            out = chunk.body(x, targets if chunk.post_process else None)
        self.outputs[key] = out
        if chunk.post_process:
            self.losses[key[0]] = float(out.data)
        elif self.local(stage + 1):  # the next stage is mine too (a V's tip)
            following = (key[0], self.chunk_of[stage + 1])
            self.inputs[following] = StageInput(out.data, requires_grad=True)

    def local(self, stage: int) -> bool:
        """Does this rank hold virtual stage `stage` (tensors then pass in memory)?"""
        return self.pipe.schedule.rank_of(stage) == self.pipe.pp_rank

    def backward(self, key, chunk: GPT, stage: int, action, split: bool = False) -> None:
        """The full backward (B), or with `split` its input half (I), leaving the
        weight gradients queued for the W action (engine.backward_input)."""
        out = self.outputs.pop(key)
        stage_input = self.embedded.pop(key) if chunk.pre_process else self.inputs.get(key)
        # d(mean over the m micro-batches)/d(loss_i) = 1/m
        grad = (np.asarray(self.scale, dtype=out.data.dtype) if chunk.post_process
                else self.out_grads.pop(key))
        # (the autograd engine charges backward's communication to the backward phase)
        with dist.timeline_label(str(action)):
            if split:
                self.weight_work[key] = backward_input(out, grad, [stage_input])
            else:
                out.backward(grad)
        if not chunk.post_process:
            dist.release(grad)
        if not chunk.pre_process and self.local(stage - 1):  # hand the gradient over
            x = self.inputs.pop(key)
            self.out_grads[(key[0], self.chunk_of[stage - 1])] = x.grad
            dist.hold(x.grad, "buffers")  # until the stage before has used it
            x.release_grad()

    def finish_sends(self) -> None:
        """Wait for the step's sends (their bytes are booked under their phase)."""
        for phase, works in self.sends.items():
            with dist.phase(phase):
                for work in works:
                    work.wait()
