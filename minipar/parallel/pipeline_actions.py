"""Pipeline actions, the Schedule that lists them per rank, and the simulator that runs
them on paper: what an action means and the rules every schedule is checked against.

Actions (micro-batch i, model chunk c of this rank, peer = the other pipeline rank):
    Forward(i, c)           run chunk c forward on micro-batch i          printed F3 / F3.1
    Backward(i, c)          backpropagate micro-batch i through chunk c    printed B3 / B3.1
    SendActivation(i, c, peer) / RecvActivation(i, c, peer)   the (b, s, h) output / input
    SendGrad(i, c, peer)    / RecvGrad(i, c, peer)            its gradient, going back
A receive sits right before the compute that needs it and a send right after the compute
that made it, so a rank blocks only when its input has not arrived yet
(`from_compute_orders` places them).

Which virtual stage chunk c of rank r runs is the schedule's placement (PLACEMENTS):
"looped" (Megatron-LM's interleaving, Narayanan et al. 2021 section 2.2.2: stage c p + r,
the chunks go round the ranks) or "v" (Qi et al. 2024's ZB-V and DeepSeek's DualPipe-V:
even chunks go down the ranks and odd ones come back up, so chunk 1 of rank r is virtual
stage 2p - 1 - r and the last stage sits on rank 0). Nothing below assumes c p + r.

`simulate_step(schedule, forward, backward, message)` is the one walker of action lists:
it checks every rule (a ScheduleError names the rank and action) while it times the
schedule with per-(rank, chunk) costs and a message cost. `validate` and `simulate` are
views of it; the planner's exact pipeline time (minipar.plan.timing) calls it. The
registry of named schedules and their generators is minipar.parallel.schedules.
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


Action = Forward | Backward | SendActivation | RecvActivation | SendGrad | RecvGrad
COMPUTE = (Forward, Backward)
ACTION_TYPES = (Forward, Backward, SendActivation, RecvActivation, SendGrad, RecvGrad)


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
    """The Schedule whose rank r runs `orders[r]`, a list of ("F" | "B", micro_batch,
    chunk): a receive right before each compute that needs one, a send right after."""
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
                if stage > 0:
                    mine.append(RecvActivation(i, c, holder[stage - 1]))
                mine.append(Forward(i, c))
                if stage < last:
                    mine.append(SendActivation(i, c, holder[stage + 1]))
            else:
                if stage < last:
                    mine.append(RecvGrad(i, c, holder[stage + 1]))
                mine.append(Backward(i, c))
                if stage > 0:
                    mine.append(SendGrad(i, c, holder[stage - 1]))
        actions.append(tuple(mine))
    return Schedule(name, pp, micro_batches, virtual_stages, tuple(actions), placement)


# --------------------------------------------------------------------------- checking
@dataclass
class SimulatedStep:
    """One step of a schedule run on paper. Per rank: `timelines[r]` its (action, start,
    end) in order; `finish` when it is done (its last action, or the arrival of its last
    send if later); `compute`, `comm` (transfers it received) and `idle` (waiting) seconds,
    compute + comm + idle = finish."""

    timelines: list[list[tuple[Action, float, float]]]
    finish: list[float]
    compute: list[float]
    comm: list[float]
    idle: list[float]


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
    `forward_time`, every backward `backward_time` and messages are free."""
    return simulate_step(schedule, forward_time, backward_time).timelines


def simulate_step(schedule: Schedule, forward=1.0, backward=2.0,
                  message: float = 0.0) -> SimulatedStep:
    """Run the schedule on paper, checking every rule, and time it.

    forward / backward: seconds of one micro-batch through chunk c on rank r,
    `forward[r][c]` (or one number for every chunk); message: seconds of one transfer.
    A send posts its message and goes on (the executor posts sends with isend). A receive
    waits for its send; the transfer then takes `message` from max(send posted, receive
    posted), a rendezvous as with NCCL; with message = 0 the receive just waits for the
    send. A rank whose next receive can never be matched is part of a deadlock.
    Raises ScheduleError on the first rule a rank breaks:
    - each (micro-batch, chunk) runs forward once and backward once, forward first;
    - a chunk that is not the first virtual stage receives its input before its forward;
      one that is not the last receives its output gradient before its backward;
    - every send names the rank that holds the neighbouring virtual stage, after the
      compute that produced it, and is received; every receive is matched by a send.
    """
    p, m, v = schedule.pp, schedule.micro_batches, schedule.virtual_stages
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for "
                            f"pp={p} ranks")
    forward, backward = _costs(forward, p, v), _costs(backward, p, v)
    last = p * v - 1
    stage_of = [[schedule.virtual_stage(r, c) for c in range(v)] for r in range(p)]
    holder = [schedule.rank_of(stage) for stage in range(p * v)]
    sent: dict[tuple, tuple[float, int]] = {}  # (kind, micro_batch, from stage) -> posted, by
    received: set[tuple] = set()
    position = [0] * p
    now = [0.0] * p
    compute, comm, idle = [0.0] * p, [0.0] * p, [0.0] * p
    send_ends: list[list[float]] = [[] for _ in range(p)]  # when each rank's sends arrived
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    forwarded: list[set] = [set() for _ in range(p)]  # (micro_batch, chunk) done
    backwarded: list[set] = [set() for _ in range(p)]
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

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            actions = schedule.actions[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if not isinstance(action, ACTION_TYPES):
                    fail(rank, action, f"not a pipeline action: {type(action).__name__}")
                i, c = action.micro_batch, action.chunk
                if not (0 <= i < m and 0 <= c < v):
                    fail(rank, action, f"micro-batch must be in [0, {m}) and chunk in [0, {v})")
                stage = stage_of[rank][c]
                start = now[rank]
                if isinstance(action, Forward):
                    if (i, c) in forwarded[rank]:
                        fail(rank, action, "this forward already ran")
                    if stage > 0 and (i, c) not in inputs[rank]:
                        fail(rank, action, "its input activation was not received first "
                                           "(a RecvActivation must come before)")
                    forwarded[rank].add((i, c))
                    now[rank] += forward[rank][c]
                    compute[rank] += forward[rank][c]
                elif isinstance(action, Backward):
                    if (i, c) not in forwarded[rank]:
                        fail(rank, action, "backward before the forward of this micro-batch")
                    if (i, c) in backwarded[rank]:
                        fail(rank, action, "this backward already ran")
                    if stage < last and (i, c) not in grads[rank]:
                        fail(rank, action, "its output gradient was not received first "
                                           "(a RecvGrad must come before)")
                    backwarded[rank].add((i, c))
                    now[rank] += backward[rank][c]
                    compute[rank] += backward[rank][c]
                elif isinstance(action, (SendActivation, SendGrad)):
                    key = key_of(rank, action)
                    done = forwarded if isinstance(action, SendActivation) else backwarded
                    if (i, c) not in done[rank]:
                        fail(rank, action, "sends a result its compute has not produced yet")
                    if key in sent:
                        fail(rank, action, "this message was already sent")
                    sent[key] = (now[rank], rank)
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
                    now[rank] = begin + message
                    comm[rank] += message
                    send_ends[sender].append(now[rank])
                    (inputs if isinstance(action, RecvActivation) else grads)[rank].add((i, c))
                timeline[rank].append((action, start, now[rank]))
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
        for what, done in (("forward", forwarded[rank]), ("backward", backwarded[rank])):
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
        end = max([now[rank], *send_ends[rank]])
        idle[rank] += end - now[rank]
        finish.append(end)
    return SimulatedStep(timeline, finish, compute, comm, idle)


def in_flight_peak(schedule: Schedule, rank: int, chunk: int | None = None) -> int:
    """Most micro-batch chunks whose forward ran and backward did not yet, on `rank` (of
    model chunk `chunk` only, if given): the micro-batches of activations it holds at once."""
    held = peak = 0
    for action in schedule.actions[rank]:
        if chunk is not None and isinstance(action, COMPUTE) and action.chunk != chunk:
            continue
        if isinstance(action, Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(action, Backward):
            held -= 1
    return peak
