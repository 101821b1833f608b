"""From compute orders to action lists: where a schedule's sends and receives go.

A schedule's generator says only in which order each rank computes, e.g. 1F1B's rank 0
of two: [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)] (kind, micro-batch, chunk).
"""

from __future__ import annotations

from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.split_backward import BackwardInput, BackwardWeight

KINDS = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}


def from_compute_orders(name: str, pp: int, micro_batches: int, virtual_stages: int,
                        orders, placement: str = "looped") -> Schedule:
    """The Schedule whose rank r runs `orders[r]` (kind in KINDS, micro_batch, chunk), with
    a receive right before each compute that needs one and a send right after, so a rank
    blocks only when its input has not arrived yet (as Megatron-LM's 1F1B posts them);
    none between two stages on one rank (they hand over in memory, split_backward.py)."""
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
