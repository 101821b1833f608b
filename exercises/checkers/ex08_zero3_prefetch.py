"""Checker of exercise 08: `zero3_actions(n_units, prefetch)`, ZeRO-3's gather / free.

The actions are first walked on paper (every compute finds its unit gathered and waited
for; nothing gathered twice at once; nothing left gathered), then run on N virtual ranks:
each unit is a (D, D) fp64 matrix whose flat parameters are sharded over the ranks;
"gather" launches `dist.all_gather(shard, async_op=True, out=buffer)` into a buffer held
in the ledger as "buffers", "wait" waits for it, "free" releases it, and a unit's forward
and backward charge the simulated clock (forward 3 all-gathers long, backward 6). Read:
- the peak of the "buffers" ledger, in units' full parameters: at most 2 with prefetch
  (the running unit and the one in flight), 1 without (stage3.py's two modes);
- the exposed communication time (the clock's `comm_s`, time blocked while data moves),
  per wait: without prefetch 2 x n_units all-gathers; with prefetch at most 2 (the first
  unit's in forward and in backward, which no compute precedes);
- the all-gathers booked: at most two per unit (its forward and its backward).
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.distributed import DeviceProfile, collective_time

from .harness import CheckFailed, expect, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "08", "ZeRO-3 gather and free, with prefetch, as actions"
BUILDING_BLOCKS = "writes the schedule itself (not the library's ZeRO-3)"
# The file's functions, and the classes their arguments and results may hold: the
# grader calls them in a process of their own and runs `check` itself (grader.py).
FUNCTIONS = ("zero3_actions",)
CLASSES = ()
FORBIDDEN = {"minipar.parallel": "the library's ZeRO-3 is the answer key",
             "Zero3Optimizer": "the library's ZeRO-3 is the answer key"}
CASES = ((1, 2), (3, 2), (4, 4), (6, 2))  # (units, N ranks)
D = 32  # a unit is a (D, D) fp64 matrix: 8 KiB gathered
KINDS = ("gather", "wait", "forward", "backward", "free")
PER_UNIT = 8  # gather, wait, compute, free: forward and backward (twice that is refused)
PROFILE = DeviceProfile()


def gather_seconds(n: int) -> float:
    """Simulated seconds of one unit's all-gather over n ranks of one node."""
    alpha, bandwidth = PROFILE.link(True)
    return collective_time("all_gather", n, D * D * 8, alpha, bandwidth)


# Compute lasts longer than the largest case's all-gather, so one prefetch hides it.
FORWARD_SECONDS = 3 * gather_seconds(max(n for _, n in CASES))
SECONDS = {"forward": FORWARD_SECONDS, "backward": 2 * FORWARD_SECONDS}


def _actions(impl, units: int, prefetch: bool) -> list[tuple[str, int]]:
    actions = impl.zero3_actions(units, prefetch)
    expect(isinstance(actions, (list, tuple)),
           f"zero3_actions({units}, {prefetch}) returned {type(actions).__name__}; return a "
           "list of (kind, unit) tuples")
    expect(len(actions) <= 2 * PER_UNIT * units,
           f"zero3_actions({units}, {prefetch}) returned {len(actions)} actions; ZeRO-3 needs "
           f"{PER_UNIT} per unit (gather, wait, compute and free, in forward and in "
           f"backward): {PER_UNIT * units}")
    out = []
    for i, action in enumerate(actions):
        ok = (isinstance(action, (list, tuple)) and len(action) == 2
              and action[0] in KINDS and isinstance(action[1], (int, np.integer))
              and not isinstance(action[1], bool) and 0 <= action[1] < units)
        expect(ok, f"zero3_actions({units}, {prefetch}): action {i} is {action!r}; each "
                   f"action is (kind, unit) with kind one of {', '.join(KINDS)} and unit in "
                   f"0..{units - 1}")
        out.append((str(action[0]), int(action[1])))
    return out


def walk(actions, units: int, where: str) -> None:
    """The actions on paper: CheckFailed at the first one that cannot run."""
    computed = [a for a in actions if a[0] in ("forward", "backward")]
    expected = ([("forward", u) for u in range(units)]
                + [("backward", u) for u in reversed(range(units))])
    expect(computed == expected,
           f"{where}: the compute order is {_text(computed)}; a forward and backward runs "
           f"{_text(expected)} (backward reaches the units in reverse)")
    launched, ready, done = set(), set(), set()
    for i, (kind, unit) in enumerate(actions):
        at = f"{where}, action {i} ({kind} {unit})"
        if kind == "gather":
            expect(unit not in launched and unit not in ready,
                   f"{at}: unit {unit} is gathered already (a second full buffer for the "
                   "same parameters)")
            launched.add(unit)
        elif kind == "wait":
            expect(unit in launched, f"{at}: no all-gather of unit {unit} is in flight "
                                     "(gather it first, and wait once)")
            launched.discard(unit)
            ready.add(unit)
        elif kind == "free":
            expect(unit in launched or unit in ready,
                   f"{at}: unit {unit} is not gathered; there is nothing to free")
            launched.discard(unit)
            ready.discard(unit)
        else:
            if unit in launched:
                raise CheckFailed(f"{at}: unit {unit}'s all-gather was launched but not "
                                  "waited for: its buffer is still arriving (on a GPU, the "
                                  "compute stream would read it before NCCL wrote it). "
                                  f"Put ('wait', {unit}) before the {kind}")
            if unit not in ready:
                why = ("its parameters were freed after its forward; gather it again "
                       "before its backward (ZeRO-3's pre-backward hook: "
                       "GatherBeforeBackward in minipar/parallel/zero/stage3.py)"
                       if kind == "backward" and ("forward", unit) in done
                       else "gather it and wait for it first")
                raise CheckFailed(f"{at}: unit {unit} is not gathered: {why}")
            done.add((kind, unit))
    left = sorted(launched | ready)
    expect(not left, f"{where}: unit(s) {', '.join(map(str, left))} still gathered at the "
                     "end; free each unit after its backward: between steps ZeRO-3 keeps "
                     "only the shards")


def _text(actions) -> str:
    return " ".join(f"{kind[0].upper()}{unit}" for kind, unit in actions)


def _program(actions, units: int, n: int) -> dict:
    group = dist.new_group(range(n), kind="dp")
    device = dist.get_device()
    rank = dist.get_rank(group)
    rng = np.random.default_rng(8)
    full = [rng.standard_normal(D * D) for _ in range(units)]
    shard = D * D // n
    shards = [f[rank * shard:(rank + 1) * shard].copy() for f in full]
    works, buffers, exposed, forwards = {}, {}, [], 0
    for kind, unit in actions:
        if kind == "gather":
            buffers[unit] = dist.hold(np.full(D * D, np.nan), "buffers")
            works[unit] = dist.all_gather(shards[unit], group=group, async_op=True,
                                          out=buffers[unit])
        elif kind == "wait":
            before = device.clock.comm_s
            works.pop(unit).wait()
            phase = "forward" if forwards < units else "backward"
            exposed.append((phase, unit, device.clock.comm_s - before))
        elif kind == "free":
            if unit in works:  # launched, never used: the transfer still has to finish
                works.pop(unit).wait()
            dist.release(buffers.pop(unit))
        else:
            # the checker's own guard: what the rank computes with is the full unit
            assert np.array_equal(buffers[unit], full[unit])
            dist.compute(SECONDS[kind] * PROFILE.flops, kind)
            forwards += kind == "forward"
    return {"peak": device.memory.peak["buffers"], "comm_s": device.clock.comm_s,
            "exposed": exposed,
            "gathers": [r.sent_bytes for r in device.comm.records if r.op == "all_gather"]}


class Case:
    def __init__(self, units: int, n: int, prefetch: bool, actions, ranks) -> None:
        self.units, self.n, self.prefetch, self.actions = units, n, prefetch, actions
        self.ranks = ranks

    def __str__(self) -> str:
        return f"{self.units} unit{'s' * (self.units > 1)}, N={self.n}, prefetch={self.prefetch}"


# ------------------------------------------------------------------ the checks
def check_on_paper(impl) -> list:
    planned = []
    for units, n in CASES:
        for prefetch in (False, True):
            actions = _actions(impl, units, prefetch)
            walk(actions, units, f"{units} units, prefetch={prefetch}")
            planned.append((units, n, prefetch, actions))
    return planned


def check_runs(planned) -> list[Case]:
    cases = []
    for units, n, prefetch, actions in planned:
        ranks = dist.launch(_program, n, actions, units, n)
        cases.append(Case(units, n, prefetch, actions, ranks))
    return cases


def check_peak(cases: list[Case]) -> None:
    unit_bytes = D * D * 8
    for case in cases:
        peak = max(r["peak"] for r in case.ranks) / unit_bytes
        allowed = 2 if case.prefetch else 1
        if peak <= allowed:
            continue
        kept = [u for u in range(case.units) if _kept_through(case.actions, u)]
        hint = ""
        if len(kept) > 1:
            hint = (f" Units {', '.join(map(str, kept))} stay gathered from their forward to "
                    "their backward: free each after its forward, as ZeRO-3 does (kept, "
                    "the gathered parameters are ZeRO-2's memory, not ZeRO-3's).")
        elif case.prefetch:
            hint = (" Prefetch only the unit that computes next, one ahead: launched "
                    "earlier, every buffer in flight is a full unit held.")
        which = ("the running unit and the one being prefetched" if case.prefetch
                 else "the running unit")
        raise CheckFailed(
            f"{case}: at the peak {peak:g} units' full parameters were gathered at once "
            f"({peak * unit_bytes:.0f} bytes); ZeRO-3 holds at most {allowed} ({which})."
            + hint)


def _kept_through(actions, unit: int) -> bool:
    """Is `unit` gathered, without a free, from its forward to its backward?"""
    start = actions.index(("forward", unit))
    end = actions.index(("backward", unit))
    return ("free", unit) not in actions[start:end]


def check_exposed(cases: list[Case]) -> None:
    for case in cases:
        g = gather_seconds(case.n)
        exposed = case.ranks[0]["comm_s"]
        allowed = 2 * g if case.prefetch else 2 * case.units * g
        if exposed <= allowed * (1 + 1e-9):
            continue
        waited = [f"{phase} of unit {unit} ({seconds / g:.2g} all-gathers)"
                  for phase, unit, seconds in case.ranks[0]["exposed"] if seconds > 1e-12]
        raise CheckFailed(
            f"{case}: {exposed * 1e6:.3g} us of exposed communication ({exposed / g:.3g} "
            f"all-gathers of {g * 1e6:.3g} us); prefetch hides all but the first unit's in "
            f"forward and in backward: at most {allowed * 1e6:.3g} us. Waited for: "
            f"{'; '.join(waited[:6])}. A prefetch hides a transfer only if compute runs "
            "between its gather and its wait: launch the next unit's all-gather before the "
            "current unit computes, and wait for it after; in backward the next unit is the "
            "previous one (u - 1).")


def check_gathers(cases: list[Case]) -> None:
    for case in cases:
        per_gather = (case.n - 1) * D * D // case.n * 8
        for rank, result in enumerate(case.ranks):
            count = len(result["gathers"])
            expect(all(b == per_gather for b in result["gathers"]),
                   f"{case}, rank {rank}: an all-gather sent other than (N-1)/N of a unit")
            expect(case.units <= count <= 2 * case.units,
                   f"{case}, rank {rank}: {count} all-gathers of "
                   f"{per_gather} bytes; each unit is gathered once for its forward and once "
                   f"for its backward: {2 * case.units} in all (a gather nothing computes "
                   "with only costs bytes and memory: backward's next unit is u - 1)")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    planned = report.run("on paper: every forward / backward finds its unit gathered and "
                         "waited for, nothing gathered twice, nothing left", check_on_paper,
                         impl)
    names = ["runs on N = 2 and 4 ranks (async all-gathers into ledger-held buffers)",
             "peak of gathered buffers: <= 2 units with prefetch, 1 without",
             "exposed communication: every all-gather without prefetch, at most 2 with",
             "bytes: each unit gathered for its forward and for its backward"]
    cases = None if planned is None else report.run(names[0], check_runs, planned)
    if cases is None:
        for name in names[0 if planned is None else 1:]:
            report.skip(name, "needs the check above")
        return report
    for name, fn in zip(names[1:], (check_peak, check_exposed, check_gathers), strict=True):
        report.run(name, fn, cases)
    return report
