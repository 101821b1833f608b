"""One pipeline rank's model: its chunks, the tied embedding, and the views of their
parameters that the optimiser, the data-parallel engines and the gradient norm read.

    pipe = Pipeline(gpt_config, pp_group=mesh.pp_group(), schedule="1f1b", micro_batches=8)
    optimizer = AdamW(pipe.named_parameters())
    loss = pipe.forward_backward(micro_batches)   # [(inputs, targets), ...] of one step
    optimizer.step(); optimizer.zero_grad()

Build it inside `minipar.distributed.launch`: every rank of the pp group builds its own
share. The step itself is executor.py (`forward_backward`); a stage is stage.py.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.errors import PipelineError
from minipar.nn import GPT, GPTConfig
from minipar.nn.optim import grad_norm_squared
from minipar.nn.recompute import Recompute
from minipar.parallel.pipeline.actions import Schedule
from minipar.parallel.pipeline.executor import forward_backward
from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import validate
from minipar.parallel.pipeline.split_backward import runtime_for
from minipar.parallel.pipeline.stage import split_layers, stage_part
from minipar.parallel.pipeline.tied_embedding import TiedEmbedding


def check_layer_split(layer_split, n_layer: int, num_stages: int) -> None:
    """Refuse a pipeline that cannot be built: more stages than layers, or explicit layer
    counts per virtual stage (`layer_split`, None = balanced) that are not one per stage,
    adding up to n_layer; the first and last stage may be empty (they still hold the
    embedding / the head), the others not."""
    if layer_split is None:
        if num_stages > n_layer:
            raise PipelineError(
                f"--pp: {num_stages} pipeline stages (pp x virtual_stages) but the model has "
                f"{n_layer} layers (--n-layer): every stage needs at least one layer; use "
                f"at most {n_layer} stages or --n-layer {num_stages} or more")
        return
    counts = [int(c) for c in layer_split]
    if len(counts) != num_stages:
        raise PipelineError(
            f"layer_split {tuple(counts)} has {len(counts)} entries for {num_stages} "
            f"stages (pp x virtual_stages): give one layer count per stage")
    if sum(counts) != n_layer:
        raise PipelineError(
            f"layer_split {tuple(counts)} adds up to {sum(counts)} layers but the model "
            f"has {n_layer} (--n-layer): make the counts add up to {n_layer}")
    for s, c in enumerate(counts):
        if c < 0 or (c == 0 and 0 < s < num_stages - 1):
            raise PipelineError(
                f"layer_split {tuple(counts)}: stage {s} gets {c} layers; a middle stage "
                f"needs at least 1 (only the first and last may be empty)")


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
    Chunk c (`chunks[c]`) runs virtual stage `stages[c]`; `actions` is my schedule's list.
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
        self.schedule, self.actions = schedule, schedule[self.pp_rank]
        self.runtime = runtime_for(schedule)  # what runs the actions (executor.Step or more)
        self.micro_batches, self.virtual_stages = micro_batches, virtual_stages
        self._counted_in_norm = None  # ids of counts_in_norm's parameters, once asked
        num_stages = self.pp * virtual_stages
        check_layer_split(layer_split, config.n_layer, num_stages)
        ranges = split_layers(config.n_layer, num_stages, layer_split)
        self.stages = [schedule.virtual_stage(self.pp_rank, c) for c in range(virtual_stages)]
        self.chunks = [build_chunk(**stage_part(stage, num_stages, ranges[stage]))
                       for stage in self.stages]
        self.tied = TiedEmbedding(config, pp_group, schedule, self.pp_rank, self.chunks)

    def forward_backward(self, micro_batches, grad_sync=None) -> float:
        """One step's forwards and backwards (executor.forward_backward); the mean loss.

        micro_batches: m pairs (inputs, targets), each (b, T) ints. Only the first stage
        reads inputs and only the last reads targets: other ranks may pass None for them.
        grad_sync: the data-parallel engine's switch (executor.forward_backward).
        """
        if len(micro_batches) != self.micro_batches:
            raise PipelineError(
                f"forward_backward got {len(micro_batches)} micro-batches but the "
                f"{self.schedule.name} schedule was built for {self.micro_batches} "
                f"(grad_accum_steps)")
        first = any(chunk.pre_process for chunk in self.chunks)
        last = any(chunk.post_process for chunk in self.chunks)
        for inputs, targets in micro_batches:
            if first and inputs is None:
                raise PipelineError("the first pipeline stage needs the micro-batch inputs")
            if last and targets is None:
                raise PipelineError("the last pipeline stage needs the micro-batch targets")
        return forward_backward(self, micro_batches, grad_sync)

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
