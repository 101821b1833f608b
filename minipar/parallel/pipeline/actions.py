"""Pipeline actions and the Schedule that lists them per rank: what a schedule is made of.

A schedule says, per pipeline rank, which actions it runs in order. An action names a
micro-batch i and a model chunk c of this rank (c = 0 unless the rank holds several
chunks); the compute actions print as in PyTorch's schedule IR
(torch/distributed/pipelining/schedules.py: F, I, W, B), "3.1" being micro-batch 3 on
chunk 1:
    Forward(i, c)           run chunk c forward on micro-batch i             F3 / F3.1
    Backward(i, c)          the full backward of micro-batch i through c     B3
    BackwardInput(i, c)     its first half, the gradient of the chunk's input, which the
                            previous stage waits for (Qi et al. 2024's "B")  I3
    BackwardWeight(i, c)    its second half, the weight gradients (their "W") W3
    SendActivation(i, c, peer) / RecvActivation(i, c, peer)   the (b, s, h) output / input
    SendGrad(i, c, peer)       / RecvGrad(i, c, peer)         its gradient, going back
(peer: the pipeline rank at the other end.) Two neighbouring virtual stages on the same
rank (the tip of a V) hand their tensors over in memory: no message, no action.

Which virtual stage chunk c of rank r runs is the schedule's placement (PLACEMENTS):
"looped" (Megatron-LM's interleaving, Narayanan et al. 2021 section 2.2.2: stage c p + r,
the chunks go round the ranks) or "v" (Qi et al. 2024's ZB-V and DeepSeek's DualPipe-V:
even chunks go down the ranks, odd ones come back up, so chunk 1 of rank r is virtual
stage 2p - 1 - r and the last stage sits on rank 0).

The schedules themselves are in minipar/parallel/pipeline/schedules/; the rules every
schedule is checked against, and its timing, in the simulator (simulator.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from minipar.errors import ScheduleError


# --------------------------------------------------------------------------- actions
def _label(micro_batch: int, chunk: int) -> str:
    return f"{micro_batch}" if chunk == 0 else f"{micro_batch}.{chunk}"


@dataclass(frozen=True)
class _Compute:
    micro_batch: int
    chunk: int = 0
    letter: ClassVar[str]

    def __str__(self) -> str:
        return self.letter + _label(self.micro_batch, self.chunk)


class Forward(_Compute):
    letter = "F"


class Backward(_Compute):
    letter = "B"


class BackwardInput(_Compute):
    letter = "I"


class BackwardWeight(_Compute):
    letter = "W"


@dataclass(frozen=True)
class _Message:
    micro_batch: int
    chunk: int
    peer: int
    what: ClassVar[str]  # "send act", "recv grad", ...
    arrow: ClassVar[str]  # "->" to the peer, "<-" from it

    def __str__(self) -> str:
        return f"{self.what} {_label(self.micro_batch, self.chunk)} {self.arrow} {self.peer}"


class SendActivation(_Message):
    what, arrow = "send act", "->"


class RecvActivation(_Message):
    what, arrow = "recv act", "<-"


class SendGrad(_Message):
    what, arrow = "send grad", "->"


class RecvGrad(_Message):
    what, arrow = "recv grad", "<-"


Action = (Forward | Backward | BackwardInput | BackwardWeight | SendActivation
          | RecvActivation | SendGrad | RecvGrad)
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
ACTION_TYPES = (*COMPUTE, SendActivation, RecvActivation, SendGrad, RecvGrad)


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
