"""The simulator: a schedule's action lists run on paper, every rule checked, timed.

`simulate_step(schedule, forward, backward, message, weight=...)` is the one walker of
action lists: it checks every rule (a ScheduleError names the rank and action) while it
times the schedule with per-(rank, chunk) costs and a message cost. `validate` and
`simulate` are views of it; the planner's exact pipeline time (minipar.plan.pipeline_step)
calls it. The actions and the Schedule are in actions.py.

Costs of one micro-batch through chunk c on rank r: forward[r][c]; backward[r][c] the full
backward (B); weight[r][c] its W part (the weight gradients), so a split backward costs
backward - weight for I and weight for W (Qi et al. 2024's T_B and T_W; default half the
backward, the two equal GEMMs of a Linear).
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.errors import ScheduleError
from minipar.parallel.pipeline.actions import (
    Action,
    Backward,
    Compute,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.split_backward import BackwardInput, BackwardWeight

# the actions whose rules simulate_step checks
ACTIONS = (Forward, Backward, BackwardInput, BackwardWeight, SendActivation, RecvActivation,
           SendGrad, RecvGrad)


@dataclass
class SimulatedStep:
    """One step of a schedule run on paper. Per rank: `timelines[r]` its (action, start,
    end) in order; `finish` when it is done (its last action, or the arrival of its last
    send if later); `compute`, `comm` (transfers it received) and `idle` (waiting) seconds,
    compute + comm + idle = finish; `sent[r]` the (start, end) of each message it sent,
    which moves when its receiver is there, while the sender computes on or not (as an
    isend's transfer does: what a profiler sees on both GPUs)."""

    timelines: list[list[tuple[Action, float, float]]]
    finish: list[float]
    compute: list[float]
    comm: list[float]
    idle: list[float]
    sent: list[list[tuple[float, float]]]


def _costs(cost, p: int, v: int) -> list[list[float]]:
    if isinstance(cost, (int, float)):
        return [[float(cost)] * v for _ in range(p)]
    return cost


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError if `schedule` cannot run to completion: see `simulate_step`."""
    simulate_step(schedule)


def simulate(schedule: Schedule, forward_time: float = 1.0,
             backward_time: float = 2.0) -> list[list[tuple[Action, float, float]]]:
    """Per rank, (action, start, end) of its actions when every chunk forward takes
    `forward_time`, every full backward `backward_time` (I and W half of it each) and
    messages are free."""
    return simulate_step(schedule, forward_time, backward_time).timelines


def simulate_step(schedule: Schedule, forward=1.0, backward=2.0,
                  message=0.0, weight=None, hold=None) -> SimulatedStep:
    """Run the schedule on paper, checking every rule, and time it.

    forward / backward / weight: seconds of one micro-batch through chunk c on rank r,
    `forward[r][c]` (or one number for every chunk); backward is the full backward, weight
    its W share (default backward / 2); message: seconds of one transfer, or
    `message(sender, receiver)` of one between those two pipeline ranks (a hop between
    nodes costs more than one inside a node); hold: {(rank, i): seconds} that rank waits
    after its i-th action, a wait the schedule does not know of (ZeRO-1's limit of
    gradient reductions in flight holding a backward), counted as communication.
    A send posts its message and goes on (the executor posts sends with isend). A receive
    waits for its send; the transfer then takes `message` from max(send posted, receive
    posted), a rendezvous as with NCCL; with message = 0 the receive just waits for the
    send. A rank whose next receive can never be matched is part of a deadlock.
    Raises ScheduleError on the first rule a rank breaks:
    - each (micro-batch, chunk) runs forward once, then either one full backward B or
      one I and later one W;
    - a chunk that is not the first virtual stage receives its input before its forward;
      one that is not the last receives its output gradient before its backward (B or I);
      from a neighbouring stage on the same rank, that stage's compute must have run;
    - every send names the rank that holds the neighbouring virtual stage, after the
      compute that produced it, and is received; every receive is matched by a send.
    """
    p, m, v = schedule.pp, schedule.micro_batches, schedule.virtual_stages
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for "
                            f"pp={p} ranks")
    forward, backward = _costs(forward, p, v), _costs(backward, p, v)
    weight = ([[b / 2 for b in row] for row in backward] if weight is None
              else _costs(weight, p, v))
    last = p * v - 1
    stage_of = [[schedule.virtual_stage(r, c) for c in range(v)] for r in range(p)]
    holder = [schedule.rank_of(stage) for stage in range(p * v)]
    chunk_of = {stage_of[r][c]: c for r in range(p) for c in range(v)}
    sent: dict[tuple, tuple[float, int]] = {}  # (kind, micro_batch, from stage) -> posted, by
    received: set[tuple] = set()
    position = [0] * p
    now = [0.0] * p
    compute, comm, idle = [0.0] * p, [0.0] * p, [0.0] * p
    sent_spans: list[list[tuple[float, float]]] = [[] for _ in range(p)]  # (start, end)
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    forwarded: list[set] = [set() for _ in range(p)]  # (micro_batch, chunk) done
    input_grads: list[set] = [set() for _ in range(p)]  # B or I done: input gradient made
    weighted: list[set] = [set() for _ in range(p)]  # B or W done: weight gradients in
    split: list[set] = [set() for _ in range(p)]  # I done, W not yet
    inputs: list[set] = [set() for _ in range(p)]  # activations received
    grads: list[set] = [set() for _ in range(p)]  # output gradients received

    def fail(rank: int, action, problem: str):
        raise ScheduleError(f"{schedule.name} schedule, rank {rank}, action {position[rank]} "
                            f"({action}): {problem}")

    def key_of(rank: int, action) -> tuple:
        """The (kind, micro_batch, sending stage) a p2p action is about; checks its peer."""
        i, c = action.micro_batch, action.chunk
        stage = stage_of[rank][c]
        if isinstance(action, (SendActivation, RecvGrad)):
            if stage == last:
                fail(rank, action, "the last virtual stage has no next stage")
            key = ("act" if isinstance(action, SendActivation) else "grad", i,
                   stage if isinstance(action, SendActivation) else stage + 1)
            peer = holder[stage + 1]
        else:
            if stage == 0:
                fail(rank, action, "the first virtual stage has no previous stage")
            key = ("act" if isinstance(action, RecvActivation) else "grad", i,
                   stage - 1 if isinstance(action, RecvActivation) else stage)
            peer = holder[stage - 1]
        if action.peer != peer:
            fail(rank, action, f"virtual stage {stage}'s neighbour lives on rank {peer}, "
                               f"not {action.peer}")
        return key

    def has_input(rank: int, i: int, stage: int) -> bool:
        if holder[stage - 1] == rank:  # handed over in memory by the stage before
            return (i, chunk_of[stage - 1]) in forwarded[rank]
        return (i, chunk_of[stage]) in inputs[rank]

    def has_output_grad(rank: int, i: int, stage: int) -> bool:
        if holder[stage + 1] == rank:
            return (i, chunk_of[stage + 1]) in input_grads[rank]
        return (i, chunk_of[stage]) in grads[rank]

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            actions = schedule.actions[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if not isinstance(action, ACTIONS):
                    fail(rank, action, f"not a pipeline action: {type(action).__name__}")
                i, c = action.micro_batch, action.chunk
                if not (0 <= i < m and 0 <= c < v):
                    fail(rank, action, f"micro-batch must be in [0, {m}) and chunk in [0, {v})")
                stage = stage_of[rank][c]
                start = now[rank]
                if isinstance(action, Forward):
                    if (i, c) in forwarded[rank]:
                        fail(rank, action, "this forward already ran")
                    if stage > 0 and not has_input(rank, i, stage):
                        fail(rank, action, "its input activation was not received first "
                                           "(a RecvActivation must come before)")
                    forwarded[rank].add((i, c))
                    cost = forward[rank][c]
                elif isinstance(action, (Backward, BackwardInput)):
                    if (i, c) not in forwarded[rank]:
                        fail(rank, action, "backward before the forward of this micro-batch")
                    if (i, c) in input_grads[rank]:
                        fail(rank, action, "this backward already ran")
                    if stage < last and not has_output_grad(rank, i, stage):
                        fail(rank, action, "its output gradient was not received first "
                                           "(a RecvGrad must come before)")
                    input_grads[rank].add((i, c))
                    if isinstance(action, Backward):
                        weighted[rank].add((i, c))
                        cost = backward[rank][c]
                    else:
                        split[rank].add((i, c))
                        cost = backward[rank][c] - weight[rank][c]
                elif isinstance(action, BackwardWeight):
                    if (i, c) not in split[rank]:
                        fail(rank, action, "a W needs the I of the same micro-batch before it "
                                           "(and runs once)")
                    split[rank].discard((i, c))
                    weighted[rank].add((i, c))
                    cost = weight[rank][c]
                elif isinstance(action, (SendActivation, SendGrad)):
                    key = key_of(rank, action)
                    done = forwarded if isinstance(action, SendActivation) else input_grads
                    if (i, c) not in done[rank]:
                        fail(rank, action, "sends a result its compute has not produced yet")
                    if key in sent:
                        fail(rank, action, "this message was already sent")
                    sent[key] = (now[rank], rank)
                    cost = 0.0
                else:  # RecvActivation, RecvGrad
                    key = key_of(rank, action)
                    if key in received:
                        fail(rank, action, "this message was already received")
                    if key not in sent:
                        break  # blocked: maybe a later pass finds it sent
                    received.add(key)
                    posted, sender = sent[key]
                    begin = max(posted, now[rank])
                    idle[rank] += begin - now[rank]
                    took = message(sender, rank) if callable(message) else message
                    now[rank] = begin + took
                    comm[rank] += took
                    sent_spans[sender].append((begin, now[rank]))
                    (inputs if isinstance(action, RecvActivation) else grads)[rank].add((i, c))
                    cost = 0.0
                if isinstance(action, Compute):
                    now[rank] += cost
                    compute[rank] += cost
                timeline[rank].append((action, start, now[rank]))
                if hold and (rank, position[rank]) in hold:
                    now[rank] += hold[rank, position[rank]]
                    comm[rank] += hold[rank, position[rank]]
                position[rank] += 1
                progress = True

    blocked = [r for r in range(p) if position[r] < len(schedule.actions[r])]
    if blocked:
        waits = "; ".join(f"rank {r} waits at action {position[r]} "
                          f"({schedule.actions[r][position[r]]})" for r in blocked)
        raise ScheduleError(f"{schedule.name} schedule deadlocks (a receive whose send never "
                            f"comes first): {waits}")
    for rank in range(p):
        expected = {(i, c) for i in range(m) for c in range(v)}
        for what, done in (("forward", forwarded[rank]), ("backward", input_grads[rank]),
                           ("weight gradient (W)", weighted[rank])):
            missing = sorted(expected - done)
            if missing:
                i, c = missing[0]
                raise ScheduleError(f"{schedule.name} schedule, rank {rank}: no {what} of "
                                    f"micro-batch {i} on chunk {c} ({len(missing)} missing)")
    unreceived = sorted(set(sent) - received)
    if unreceived:
        kind, i, stage = unreceived[0]
        raise ScheduleError(f"{schedule.name} schedule: the {kind} of micro-batch {i} sent by "
                            f"virtual stage {stage} is never received")
    finish = []
    for rank in range(p):  # a rank is done when its own sends have arrived
        end = max([now[rank], *(arrived for _, arrived in sent_spans[rank])])
        idle[rank] += end - now[rank]
        finish.append(end)
    return SimulatedStep(timeline, finish, compute, comm, idle, sent_spans)


def in_flight_peak(schedule: Schedule, rank: int, chunk: int | None = None) -> int:
    """Most micro-batch chunks whose forward ran and whose backward has not finished (B,
    or W after an I), on `rank` (of model chunk `chunk` only, if given): the micro-batches
    of activations (or, between I and W, of what W still needs) it holds at once."""
    held = peak = 0
    for action in schedule.actions[rank]:
        if chunk is not None and isinstance(action, Compute) and action.chunk != chunk:
            continue
        if isinstance(action, Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(action, (Backward, BackwardWeight)):
            held -= 1
    return peak
