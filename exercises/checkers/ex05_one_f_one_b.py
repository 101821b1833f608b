"""Checker of exercise 05: `compute_order(pp, m, stage)` and `one_f_one_b(pp, m)`.

The expected compute order is derived here from the PipeDream-Flush rules (Narayanan et
al. 2021, section 2.2.1): stage s runs min(p - s - 1, m) warm-up forwards, then one
forward and one backward in turn, then the remaining backwards. The action lists are
- validated on paper by `minipar.parallel.pipeline.simulator.simulate` (every send received by
  the right neighbour, every receive sent, inputs received before use, no wait cycle);
- run on p virtual ranks with minipar.distributed (isend for sends, a blocking recv for
  receives, as Megatron-LM's p2p code): no DeadlockError, and every receive gets the
  message it names;
- measured: micro-batches in flight per stage (at most min(p - s, m)) and the ideal
  step time with forward 1 and backward 2 units ((m + p - 1) * 3, bubble
  (p - 1)/(m + p - 1), section 2.2 of the paper).
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.distributed import DeadlockError
from minipar.errors import ScheduleError
from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.simulator import in_flight_peak, simulate

from .harness import CheckFailed, expect, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "05", "the 1F1B pipeline schedule as action lists"
# The check of the file's text, which the grader also runs on its own copy (grader.py).
BUILDING_BLOCKS = "builds the lists itself (not the library's schedules)"
# The file's functions, and the classes their arguments and results may hold: the
# grader calls them in a process of their own and runs `check` itself (grader.py).
FUNCTIONS = ("compute_order", "one_f_one_b")
ACTIONS = (Forward, Backward, SendActivation, RecvActivation, SendGrad, RecvGrad)
CLASSES = ACTIONS
CASES = ((1, 3), (2, 4), (3, 5), (4, 8), (4, 2), (4, 4))  # (p, m); m < p in (4, 2)
FORWARD_TIME, BACKWARD_TIME = 1.0, 2.0

FORBIDDEN = {name: "the library's schedule is the answer key; build the lists yourself"
             for name in ("one_f_one_b", "gpipe", "interleaved_1f1b", "make_schedule",
                          "from_compute_orders")}

DEADLOCK_HINT = ("every receive must be matched by its neighbour's send, and the sender must "
                 "reach that send without first waiting for the receiver: compare the two "
                 "ranks' lists in the message above")


def pipedream_flush(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B compute order of `stage`, from the paper's rules."""
    warmup = min(p - stage - 1, m)
    forwards, backwards = iter(range(m)), iter(range(m))
    order = [("F", next(forwards)) for _ in range(warmup)]
    for _ in range(m - warmup):
        order.append(("F", next(forwards)))
        order.append(("B", next(backwards)))
    order += [("B", i) for i in backwards]
    return order


def _text(order) -> str:
    return " ".join(f"{kind}{i}" for kind, i in order)


def _first_difference(got: list, expected: list) -> int:
    for k, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return k
    return min(len(got), len(expected))


def _explain_order(p: int, m: int, stage: int, got: list, expected: list) -> str:
    k = _first_difference(got, expected)
    warmup = min(p - stage - 1, m)
    return (f"p={p}, m={m}, stage {stage}: the order differs at position {k}\n"
            f"  got      {_text(got)}\n"
            f"  expected {_text(expected)}\n"
            f"  (stage {stage} warms up with min(p - s - 1, m) = {warmup} forwards, then "
            "alternates F and B, then cools down with the remaining B)")


# ------------------------------------------------------------------ the checks
def check_compute_order(impl) -> None:
    for p, m in CASES:
        for stage in range(p):
            got = impl.compute_order(p, m, stage)
            try:
                got = [(str(kind), int(i)) for kind, i in got]
            except (TypeError, ValueError):
                raise CheckFailed(f"compute_order({p}, {m}, {stage}) returned {got!r}; "
                                  "return a list of ('F' or 'B', micro-batch) pairs") from None
            expected = pipedream_flush(p, m, stage)
            if got != expected:
                raise CheckFailed(_explain_order(p, m, stage, got, expected))


def check_lists(impl) -> dict:
    schedules = {}
    for p, m in CASES:
        lists = impl.one_f_one_b(p, m)
        expect(isinstance(lists, (list, tuple)) and len(lists) == p,
               f"one_f_one_b({p}, {m}) returned {type(lists).__name__} of "
               f"{len(lists) if hasattr(lists, '__len__') else '?'} entries; expected a list "
               f"of {p} action lists, one per rank")
        for rank, actions in enumerate(lists):
            for k, action in enumerate(actions):
                expect(isinstance(action, ACTIONS),
                       f"one_f_one_b({p}, {m}): rank {rank}'s action {k} is {action!r}, not one "
                       "of Forward, Backward, Send/RecvActivation, Send/RecvGrad")
                expect(action.chunk == 0,
                       f"one_f_one_b({p}, {m}): rank {rank}'s action {k} ({action}) uses model "
                       f"chunk {action.chunk}; 1F1B has one chunk per rank: chunk 0")
        schedules[(p, m)] = Schedule("1f1b", p, m, 1, tuple(tuple(a) for a in lists))
    return schedules


def check_order_in_lists(schedules: dict) -> None:
    for (p, m), schedule in schedules.items():
        for stage in range(p):
            got = [("F" if isinstance(a, Forward) else "B", a.micro_batch)
                   for a in schedule[stage] if isinstance(a, (Forward, Backward))]
            expected = pipedream_flush(p, m, stage)
            if got != expected:
                raise CheckFailed("in one_f_one_b's lists: "
                                  + _explain_order(p, m, stage, got, expected))


def check_messages_pair_up(schedules: dict) -> None:
    for (p, m), schedule in schedules.items():
        try:
            simulate(schedule, FORWARD_TIME, BACKWARD_TIME)
        except ScheduleError as error:
            raise CheckFailed(f"p={p}, m={m}: {error}") from None


KIND = {SendActivation: 0, RecvActivation: 0, SendGrad: 1, RecvGrad: 1}
NAMES = ("activation", "gradient")


def _execute(schedule: Schedule) -> None:
    """One pipeline rank walks its actions: sends are isends, receives block."""
    rank, p = dist.get_rank(), schedule.pp
    group = dist.new_group(range(p), kind="pp")
    pending = []
    for action in schedule[rank]:
        if isinstance(action, (Forward, Backward)):
            continue
        kind = KIND[type(action)]
        if isinstance(action, (SendActivation, SendGrad)):
            # The message says what it is, so the receiver can check it got the right one.
            message = np.array([kind, action.micro_batch, rank])
            pending.append(dist.isend(message, action.peer, group=group, tag=kind))
        else:
            got = dist.recv(action.peer, group=group, tag=kind)
            expected = [kind, action.micro_batch, action.peer]
            if list(got) != expected:
                raise CheckFailed(
                    f"p={p}, m={schedule.micro_batches}: rank {rank} waited for the "
                    f"{NAMES[kind]} of micro-batch {action.micro_batch} from rank "
                    f"{action.peer} ({action}) but the next one from rank {action.peer} is "
                    f"micro-batch {got[1]}'s: messages between two ranks arrive in the "
                    "order they are sent, so sends and receives must come in the same order")
    for request in pending:
        request.wait()


def check_runs(schedules: dict) -> None:
    for (p, m), schedule in schedules.items():
        try:
            dist.launch(_execute, p, schedule)
        except DeadlockError as error:
            raise CheckFailed(f"p={p}, m={m}: {error}\n  hint: {DEADLOCK_HINT}") from None


def check_in_flight(schedules: dict) -> None:
    for (p, m), schedule in schedules.items():
        for stage in range(p):
            peak, bound = in_flight_peak(schedule, stage), min(p - stage, m)
            expect(peak <= bound,
                   f"p={p}, m={m}: stage {stage} has {peak} micro-batches in flight (forward "
                   f"done, backward not yet) at its peak; 1F1B keeps at most min(p - s, m) = "
                   f"{bound}: start each backward as early as the rules allow")


def check_time(schedules: dict) -> str:
    for (p, m), schedule in schedules.items():
        try:
            timeline = simulate(schedule, FORWARD_TIME, BACKWARD_TIME)
        except ScheduleError:
            raise CheckFailed(f"p={p}, m={m}: the schedule does not run (see above), so it "
                              "has no step time") from None
        end = max((e for row in timeline for _, _, e in row), default=0.0)
        ideal = (m + p - 1) * (FORWARD_TIME + BACKWARD_TIME)
        expect(abs(end - ideal) < 1e-9,
               f"p={p}, m={m}: the step takes {end:g} time units; 1F1B takes "
               f"(m + p - 1)(t_f + t_b) = {ideal:g} (bubble (p - 1)/(m + p - 1) = "
               f"{(p - 1) / (m + p - 1):.2f})")
    return ""


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    report.run("compute_order follows PipeDream-Flush (warm-up, 1F1B, cool-down)",
               check_compute_order, impl)
    schedules = report.run("one_f_one_b returns one list of pipeline actions per rank",
                           check_lists, impl)
    checks = [
        ("the lists' forwards and backwards are in 1F1B order", check_order_in_lists),
        ("every send is received, every receive is sent, by the right neighbour",
         check_messages_pair_up),
        ("runs on p virtual ranks without deadlock; each receive gets its message",
         check_runs),
        ("at most min(p - s, m) micro-batches in flight on stage s", check_in_flight),
        ("step time (m + p - 1)(t_f + t_b): no bubble beyond (p - 1)/(m + p - 1)",
         check_time),
    ]
    for name, fn in checks:
        if schedules is None:
            report.skip(name, "needs one_f_one_b's lists")
        else:
            report.run(name, fn, schedules, hints={DeadlockError: DEADLOCK_HINT})
    return report
