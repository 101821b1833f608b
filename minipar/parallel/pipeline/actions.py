"""Pipeline actions and the Schedule that lists them per rank: what an action means.

Actions (micro-batch i, model chunk c of this rank, peer = the other pipeline rank), printed
as in PyTorch's schedule IR (torch/distributed/pipelining/schedules.py: F, I, W, B):
    Forward(i, c)           run chunk c forward on micro-batch i          printed F3 / F3.1
    Backward(i, c)          full backward of micro-batch i through chunk c printed B3 / B3.1
    BackwardInput(i, c)     its B half only: the gradient of the chunk's input, what the
                            previous stage waits for (Qi et al. 2024's "B")  printed I3
    BackwardWeight(i, c)    its W half: the weight gradients B left queued   printed W3
    SendActivation(i, c, peer) / RecvActivation(i, c, peer)   the (b, s, h) output / input
    SendGrad(i, c, peer)    / RecvGrad(i, c, peer)            its gradient, going back
A receive sits right before the compute that needs it and a send right after the compute
that made it, so a rank blocks only when its input has not arrived yet
(`from_compute_orders` places them). Two neighbouring virtual stages on the same rank (the
tip of a V) hand their tensors over in memory: no message, no action.

Which virtual stage chunk c of rank r runs is the schedule's placement (PLACEMENTS):
"looped" (Megatron-LM's interleaving, Narayanan et al. 2021 section 2.2.2: stage c p + r,
the chunks go round the ranks) or "v" (Qi et al. 2024's ZB-V and DeepSeek's DualPipe-V:
even chunks go down the ranks and odd ones come back up, so chunk 1 of rank r is virtual
stage 2p - 1 - r and the last stage sits on rank 0). Nothing below assumes c p + r.

The rules every schedule is checked against, and its timing, are the simulator's
(pipeline_simulator.py: `simulate_step`, `validate`, `simulate`). The registry of named
schedules and their generators is minipar.parallel.pipeline.schedules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from minipar.errors import PipelineError, ScheduleError  # noqa: F401 (re-exported)

# PipelineError: a pipeline setting that cannot work; ScheduleError (a PipelineError): a
# schedule that cannot run. Both MiniparErrors (minipar/errors.py), re-exported here.


# --------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Forward:
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return "F" + _name(self.micro_batch, self.chunk)


@dataclass(frozen=True)
class Backward:
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return "B" + _name(self.micro_batch, self.chunk)


@dataclass(frozen=True)
class BackwardInput:
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return "I" + _name(self.micro_batch, self.chunk)


@dataclass(frozen=True)
class BackwardWeight:
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return "W" + _name(self.micro_batch, self.chunk)


@dataclass(frozen=True)
class SendActivation:
    micro_batch: int
    chunk: int
    peer: int

    def __str__(self) -> str:
        return f"send act {_name(self.micro_batch, self.chunk)} -> {self.peer}"


@dataclass(frozen=True)
class RecvActivation:
    micro_batch: int
    chunk: int
    peer: int

    def __str__(self) -> str:
        return f"recv act {_name(self.micro_batch, self.chunk)} <- {self.peer}"


@dataclass(frozen=True)
class SendGrad:
    micro_batch: int
    chunk: int
    peer: int

    def __str__(self) -> str:
        return f"send grad {_name(self.micro_batch, self.chunk)} -> {self.peer}"


@dataclass(frozen=True)
class RecvGrad:
    micro_batch: int
    chunk: int
    peer: int

    def __str__(self) -> str:
        return f"recv grad {_name(self.micro_batch, self.chunk)} <- {self.peer}"


Action = (Forward | Backward | BackwardInput | BackwardWeight | SendActivation
          | RecvActivation | SendGrad | RecvGrad)
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
ACTION_TYPES = (*COMPUTE, SendActivation, RecvActivation, SendGrad, RecvGrad)
KINDS = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}


def _name(micro_batch: int, chunk: int) -> str:
    return f"{micro_batch}" if chunk == 0 else f"{micro_batch}.{chunk}"


# --------------------------------------------------------------------------- placements
def looped(pp: int, rank: int, chunk: int) -> int:
    """Megatron-LM's interleaving: chunk c of rank r is virtual stage c p + r."""
    return chunk * pp + rank


def v_shape(pp: int, rank: int, chunk: int) -> int:
    """ZB-V / DualPipe-V: even chunks run down the ranks, odd chunks back up (chunk 1 of
    rank r is virtual stage 2p - 1 - r), so rank 0 holds the first and the last stage."""
    return chunk * pp + (rank if chunk % 2 == 0 else pp - 1 - rank)


PLACEMENTS = {"looped": looped, "v": v_shape}


# --------------------------------------------------------------------------- the schedule
@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the actions it runs in order. `schedule[r]` is rank r's list.

    pp: pipeline ranks; micro_batches: m per optimizer step (= grad_accum_steps);
    virtual_stages: v model chunks per rank; placement: how (rank, chunk) maps to a
    virtual stage, a key of PLACEMENTS ("looped": chunk c of rank r is stage c*pp + r).
    """

    name: str
    pp: int
    micro_batches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "looped"

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self):
        return iter(self.actions)

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return PLACEMENTS[self.placement](self.pp, rank, chunk)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds virtual stage `stage`."""
        if stage not in self._holders:
            raise ScheduleError(f"{self.name}: no rank holds virtual stage {stage}")
        return self._holders[stage]

    @functools.cached_property
    def _holders(self) -> dict[int, int]:  # virtual stage -> rank, computed once
        return {self.virtual_stage(rank, chunk): rank for rank in range(self.pp)
                for chunk in range(self.virtual_stages)}

    def compute_order(self, rank: int) -> str:
        """Rank's forwards and backwards only, e.g. "F0 F1 F2 B0 F3 B1 B2 B3"."""
        return " ".join(str(a) for a in self.actions[rank] if isinstance(a, COMPUTE))

    def __str__(self) -> str:
        head = (f"{self.name} schedule: pp={self.pp}, micro_batches={self.micro_batches}"
                + (f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        lines = [head]
        for rank, actions in enumerate(self.actions):
            lines.append(f"rank {rank}: " + ", ".join(str(a) for a in actions))
        return "\n".join(lines)


def from_compute_orders(name: str, pp: int, micro_batches: int, virtual_stages: int,
                        orders, placement: str = "looped") -> Schedule:
    """The Schedule whose rank r runs `orders[r]`, a list of (kind, micro_batch, chunk),
    kind one of KINDS ("F", "B", "I", "W"): a receive right before each compute that
    needs one, a send right after; none between two stages on the same rank."""
    skeleton = Schedule(name, pp, micro_batches, virtual_stages, (), placement)
    last = pp * virtual_stages - 1
    holder = [skeleton.rank_of(stage) for stage in range(last + 1)]
    actions = []
    for rank, order in enumerate(orders):
        stage_of = [skeleton.virtual_stage(rank, c) for c in range(virtual_stages)]
        mine = []
        for kind, i, c in order:
            stage = stage_of[c]
            if kind == "F":
                if stage > 0 and holder[stage - 1] != rank:
                    mine.append(RecvActivation(i, c, holder[stage - 1]))
                mine.append(Forward(i, c))
                if stage < last and holder[stage + 1] != rank:
                    mine.append(SendActivation(i, c, holder[stage + 1]))
            elif kind in ("B", "I"):
                if stage < last and holder[stage + 1] != rank:
                    mine.append(RecvGrad(i, c, holder[stage + 1]))
                mine.append(KINDS[kind](i, c))
                if stage > 0 and holder[stage - 1] != rank:
                    mine.append(SendGrad(i, c, holder[stage - 1]))
            else:
                mine.append(KINDS[kind](i, c))
        actions.append(tuple(mine))
    return Schedule(name, pp, micro_batches, virtual_stages, tuple(actions), placement)
