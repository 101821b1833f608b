"""Pipeline schedules as data: per pipeline rank, the list of actions it runs in order.

    schedule = make_schedule("1f1b", pp=4, micro_batches=8)
    print(schedule)                 # one line per rank: F0 send act 0 -> 1 F1 ...
    schedule[2]                     # rank 2's actions: [RecvActivation(0, 0, 1), Forward(0), ...]
    validate(schedule)              # raises ScheduleError naming the first problem
    timeline = simulate(schedule)   # ideal timings with unit-cost stages, free communication

Actions (micro-batch i, model chunk c of this rank, peer = the other pipeline rank):
    Forward(i, c)           run chunk c forward on micro-batch i          printed F3 / F3.1
    Backward(i, c)          backpropagate micro-batch i through chunk c    printed B3 / B3.1
    SendActivation(i, c, peer) / RecvActivation(i, c, peer)   the (b, s, h) output / input
    SendGrad(i, c, peer)    / RecvGrad(i, c, peer)            its gradient, going back
A receive sits right before the compute that needs it and a send right after the compute
that made it, so a rank blocks only when its input has not arrived yet.

Three schedules, all "flushing" (every micro-batch of an optimizer step finishes before the
weights change, so the result equals single-device gradient accumulation):
- GPipe (Huang et al. 2019): every forward, then every backward. Holds the activations of
  all m micro-batches at once.
- 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", section 2.2.1, Figure 3): stage s runs
  p - s - 1 warm-up forwards, then alternates one forward and one backward, then cools
  down. Same bubble as GPipe, but at most p - s micro-batches in flight.
- Interleaved 1F1B (same paper, section 2.2.2, Figure 4): each rank holds v model chunks
  (chunk c of rank r is virtual stage c*p + r) and micro-batches go through the chunks in
  groups of p. The bubble shrinks by v: (p - 1) / (v*m + p - 1) of the time, for
  v times more point-to-point messages. Order and warm-up follow Megatron-LM's
  `forward_backward_pipelining_with_interleaving`, so m must be a multiple of p.

Bubble with uniform stages and free communication (t_f, t_b: forward and backward time of
one micro-batch on one stage), from section 2.2 of the paper:
    GPipe, 1F1B:   idle / total = (p - 1) / (m + p - 1)
    interleaved:   idle / total = (p - 1) / (v*m + p - 1)    (bubble (1/v)(p-1)/m of ideal)
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")


class PipelineError(ValueError):
    """A pipeline setting that cannot work (the message names the flag and the fix)."""


class ScheduleError(PipelineError):
    """A schedule that cannot run: a missing or misplaced action, a send nobody receives,
    a cycle of waits; or a setting no schedule exists for."""


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


# --------------------------------------------------------------------------- the schedule
@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the actions it runs in order. `schedule[r]` is rank r's list.

    pp: pipeline ranks; micro_batches: m per optimizer step (= grad_accum_steps);
    virtual_stages: v model chunks per rank (chunk c of rank r is virtual stage c*pp + r).
    """

    name: str
    pp: int
    micro_batches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self):
        return iter(self.actions)

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

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


def _with_messages(pp: int, v: int, rank: int, order: list[tuple[str, int, int]]) -> tuple:
    """Rank's actions from its compute order [("F"|"B", micro_batch, chunk), ...]: a
    receive right before each compute that needs one, a send right after."""
    last = pp * v - 1
    actions = []
    for kind, i, c in order:
        stage = c * pp + rank
        prev_rank, next_rank = (rank - 1) % pp, (rank + 1) % pp
        if kind == "F":
            if stage > 0:
                actions.append(RecvActivation(i, c, prev_rank))
            actions.append(Forward(i, c))
            if stage < last:
                actions.append(SendActivation(i, c, next_rank))
        else:
            if stage < last:
                actions.append(RecvGrad(i, c, next_rank))
            actions.append(Backward(i, c))
            if stage > 0:
                actions.append(SendGrad(i, c, prev_rank))
    return tuple(actions)


def _check_sizes(pp: int, micro_batches: int, virtual_stages: int = 1) -> None:
    for name, value in (("pp", pp), ("micro_batches (grad_accum_steps)", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"schedule: {name} must be a positive integer, got {value!r}")


def gpipe(pp: int, micro_batches: int) -> Schedule:
    """GPipe: all m forwards, then all m backwards (Huang et al. 2019, Figure 2c)."""
    _check_sizes(pp, micro_batches)
    m = micro_batches
    order = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    actions = tuple(_with_messages(pp, 1, r, order) for r in range(pp))
    return Schedule("gpipe", pp, m, 1, actions)


def one_f_one_b(pp: int, micro_batches: int) -> Schedule:
    """1F1B / PipeDream-Flush: stage s runs min(p - s - 1, m) warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards (cool-down)."""
    _check_sizes(pp, micro_batches)
    m = micro_batches
    actions = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]
        actions.append(_with_messages(pp, 1, rank, order))
    return Schedule("1f1b", pp, m, 1, tuple(actions))


def interleaved_1f1b(pp: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B with v model chunks per rank (Narayanan et al. 2021, Figure 4).

    The k-th forward of a rank (k = 0 .. m*v - 1) is micro-batch (k // (p*v)) * p + k % p
    on chunk (k // p) % v: p micro-batches go through chunk 0, the same p through chunk 1,
    and so on; backwards visit the chunks in reverse. Rank r runs
    2 (p - r - 1) + (v - 1) p warm-up forwards (all of them when m == p), then 1F1B, then
    cools down, as Megatron-LM does.
    """
    _check_sizes(pp, micro_batches, virtual_stages)
    p, m, v = pp, micro_batches, virtual_stages
    check_schedule_settings("interleaved", p, m, v)
    total = m * v

    def unit(k: int, forward: bool) -> tuple[str, int, int]:
        group, index = divmod(k, p * v)
        chunk = index // p
        return ("F" if forward else "B", group * p + index % p,
                chunk if forward else v - 1 - chunk)

    actions = []
    for rank in range(p):
        if m == p:
            warmup = total
        else:
            warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        order = [unit(k, True) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(warmup + k, True), unit(k, False)]
        order += [unit(k, False) for k in range(total - warmup, total)]
        actions.append(_with_messages(p, v, rank, order))
    return Schedule("interleaved", p, m, v, tuple(actions))


def check_schedule_settings(name: str, pp: int, micro_batches: int,
                            virtual_stages: int = 1) -> None:
    """Raise ScheduleError (naming the flag and the fix) if `name` cannot schedule these."""
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"--schedule: unknown pipeline schedule {name!r}; use one of "
                            f"{', '.join(SCHEDULE_NAMES)}")
    if name != "interleaved":
        if virtual_stages != 1:
            raise ScheduleError(
                f"--virtual-stages {virtual_stages}: only the interleaved schedule runs "
                f"several model chunks per rank; use --schedule interleaved or "
                f"--virtual-stages 1")
        return
    if virtual_stages < 2:
        raise ScheduleError(
            "--virtual-stages: the interleaved schedule needs at least 2 model chunks per "
            "rank (with 1 it is plain 1F1B); use --virtual-stages 2 or --schedule 1f1b")
    if pp < 2:
        raise ScheduleError("--pp: the interleaved schedule needs at least 2 pipeline ranks; "
                            "use --pp 2 or more, or --schedule 1f1b")
    if micro_batches % pp:
        lower = max(pp, micro_batches // pp * pp)
        raise ScheduleError(
            f"--grad-accum-steps: the interleaved schedule sends micro-batches through the "
            f"model chunks in groups of pp={pp}, so the micro-batch count must be a multiple "
            f"of {pp} (Megatron-LM has the same rule); got {micro_batches}: use "
            f"--grad-accum-steps {lower} or {lower + pp}")


def make_schedule(name: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe" | "1f1b" | "interleaved"), validated."""
    _check_sizes(pp, micro_batches, virtual_stages)
    check_schedule_settings(name, pp, micro_batches, virtual_stages)
    if name == "gpipe":
        schedule = gpipe(pp, micro_batches)
    elif name == "1f1b":
        schedule = one_f_one_b(pp, micro_batches)
    else:
        schedule = interleaved_1f1b(pp, micro_batches, virtual_stages)
    validate(schedule)
    return schedule


# --------------------------------------------------------------------------- checking
def validate(schedule: Schedule) -> None:
    """Raise ScheduleError if `schedule` cannot run to completion: see `simulate`."""
    simulate(schedule)


def simulate(schedule: Schedule, forward_time: float = 1.0,
             backward_time: float = 2.0) -> list[list[tuple[Action, float, float]]]:
    """Run the schedule on paper and return, per rank, (action, start, end) of its actions.

    Every chunk forward takes `forward_time`, every backward `backward_time`; messages are
    free and a send never blocks (the executor posts sends with isend). A receive waits
    for its send; a rank whose next receive can never be matched is part of a deadlock.
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
    last = p * v - 1
    sent: dict[tuple, float] = {}  # (kind, micro_batch, from stage) -> time it was posted
    received: set[tuple] = set()
    position = [0] * p
    now = [0.0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    forwarded: list[set] = [set() for _ in range(p)]  # (micro_batch, chunk) done
    backwarded: list[set] = [set() for _ in range(p)]
    inputs: list[set] = [set() for _ in range(p)]  # activations received
    grads: list[set] = [set() for _ in range(p)]  # output gradients received

    def fail(rank: int, action, problem: str):
        raise ScheduleError(f"{schedule.name} schedule, rank {rank}, action {position[rank]} "
                            f"({action}): {problem}")

    def message(rank: int, action) -> tuple:
        """The (kind, micro_batch, sending stage) a p2p action is about; checks its peer."""
        i, c = action.micro_batch, action.chunk
        stage = c * p + rank
        if isinstance(action, (SendActivation, RecvGrad)):
            if stage == last:
                fail(rank, action, "the last virtual stage has no next stage")
            key = ("act" if isinstance(action, SendActivation) else "grad", i,
                   stage if isinstance(action, SendActivation) else stage + 1)
            peer = (stage + 1) % p
        else:
            if stage == 0:
                fail(rank, action, "the first virtual stage has no previous stage")
            key = ("act" if isinstance(action, RecvActivation) else "grad", i,
                   stage - 1 if isinstance(action, RecvActivation) else stage)
            peer = (stage - 1) % p
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
                stage = c * p + rank
                start = now[rank]
                if isinstance(action, Forward):
                    if (i, c) in forwarded[rank]:
                        fail(rank, action, "this forward already ran")
                    if stage > 0 and (i, c) not in inputs[rank]:
                        fail(rank, action, "its input activation was not received first "
                                           "(a RecvActivation must come before)")
                    forwarded[rank].add((i, c))
                    now[rank] += forward_time
                elif isinstance(action, Backward):
                    if (i, c) not in forwarded[rank]:
                        fail(rank, action, "backward before the forward of this micro-batch")
                    if (i, c) in backwarded[rank]:
                        fail(rank, action, "this backward already ran")
                    if stage < last and (i, c) not in grads[rank]:
                        fail(rank, action, "its output gradient was not received first "
                                           "(a RecvGrad must come before)")
                    backwarded[rank].add((i, c))
                    now[rank] += backward_time
                elif isinstance(action, (SendActivation, SendGrad)):
                    key = message(rank, action)
                    done = forwarded if isinstance(action, SendActivation) else backwarded
                    if (i, c) not in done[rank]:
                        fail(rank, action, "sends a result its compute has not produced yet")
                    if key in sent:
                        fail(rank, action, "this message was already sent")
                    sent[key] = now[rank]
                else:  # RecvActivation, RecvGrad
                    key = message(rank, action)
                    if key in received:
                        fail(rank, action, "this message was already received")
                    if key not in sent:
                        break  # blocked: maybe a later pass finds it sent
                    received.add(key)
                    now[rank] = max(now[rank], sent[key])
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
    return timeline


def in_flight_peak(schedule: Schedule, rank: int) -> int:
    """Most micro-batch chunks whose forward ran and backward did not yet, on `rank`: the
    number of micro-batches of activations it must hold at once."""
    held = peak = 0
    for action in schedule.actions[rank]:
        if isinstance(action, Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(action, Backward):
            held -= 1
    return peak
