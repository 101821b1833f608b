"""What a pipeline schedule is made of: per rank, the actions it runs in order.

An action names a micro-batch i and a model chunk c of this rank (c = 0 unless the rank
holds several); they print as in PyTorch's schedule IR (torch/distributed/pipelining/
schedules.py), "3.1" being micro-batch 3 on chunk 1:
    Forward(i, c)           run chunk c forward on micro-batch i             F3 / F3.1
    Backward(i, c)          the full backward of micro-batch i through c     B3
    SendActivation(i, c, peer) / RecvActivation(i, c, peer)   the (b, s, h) output / input
    SendGrad(i, c, peer)       / RecvGrad(i, c, peer)         its gradient, going back
(peer: the pipeline rank at the other end; split_backward.py adds I and W).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from minipar.errors import ScheduleError
from minipar.parallel.pipeline.placements import PLACEMENTS


def _label(micro_batch: int, chunk: int) -> str:
    return f"{micro_batch}" if chunk == 0 else f"{micro_batch}.{chunk}"


@dataclass(frozen=True)
class Compute:
    micro_batch: int
    chunk: int = 0
    letter: ClassVar[str]

    def __str__(self) -> str:
        return self.letter + _label(self.micro_batch, self.chunk)


class Forward(Compute):
    letter = "F"


class Backward(Compute):
    letter = "B"


@dataclass(frozen=True)
class Message:
    micro_batch: int
    chunk: int
    peer: int
    what: ClassVar[str]  # "send act", "recv grad", ...
    arrow: ClassVar[str]  # "->" to the peer, "<-" from it

    def __str__(self) -> str:
        return f"{self.what} {_label(self.micro_batch, self.chunk)} {self.arrow} {self.peer}"


class SendActivation(Message):
    what, arrow = "send act", "->"


class RecvActivation(Message):
    what, arrow = "recv act", "<-"


class SendGrad(Message):
    what, arrow = "send grad", "->"


class RecvGrad(Message):
    what, arrow = "recv grad", "<-"


Action = Compute | Message


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the actions it runs in order. `schedule[r]` is rank r's list.

    pp: pipeline ranks; micro_batches: m per optimizer step (= grad_accum_steps);
    virtual_stages: v model chunks per rank; placement: a key of placements.PLACEMENTS,
    which virtual stage chunk c of rank r runs (with v = 1: stage r).
    """

    name: str
    pp: int
    micro_batches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "looped"

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

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
    def _holders(self) -> dict[int, int]:  # virtual stage -> rank
        return {self.virtual_stage(r, c): r for r in range(self.pp)
                for c in range(self.virtual_stages)}

    def compute_order(self, rank: int) -> str:
        """Rank's forwards and backwards only, e.g. "F0 F1 F2 B0 F3 B1 B2 B3"."""
        return " ".join(str(a) for a in self.actions[rank] if isinstance(a, Compute))

    def __str__(self) -> str:
        head = (f"{self.name} schedule: pp={self.pp}, micro_batches={self.micro_batches}"
                + (f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return "\n".join([head] + [f"rank {rank}: " + ", ".join(map(str, actions))
                                    for rank, actions in enumerate(self.actions)])
