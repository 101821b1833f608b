"""Reference solution of exercise 05: the 1F1B schedule as action lists."""

from __future__ import annotations

from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)


def compute_order(pp: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    m = micro_batches
    warmup = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]  # cool-down
    return order


def one_f_one_b(pp: int, micro_batches: int) -> list[list]:
    schedule = []
    for rank in range(pp):
        first, last = rank == 0, rank == pp - 1
        actions = []
        for kind, i in compute_order(pp, micro_batches, rank):
            if kind == "F":
                if not first:
                    actions.append(RecvActivation(i, 0, rank - 1))
                actions.append(Forward(i))
                if not last:
                    actions.append(SendActivation(i, 0, rank + 1))
            else:
                if not last:
                    actions.append(RecvGrad(i, 0, rank + 1))
                actions.append(Backward(i))
                if not first:
                    actions.append(SendGrad(i, 0, rank - 1))
        schedule.append(actions)
    return schedule
