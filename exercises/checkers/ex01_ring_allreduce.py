"""Checker of exercise 01: `ring_all_reduce(x, group)` built from send/recv.

Runs the implementation on n = 2, 3, 4 virtual ranks (even and uneven chunks, fewer
elements than ranks, float32, two sub-groups at once) and holds it against:
- values: NumPy's sum of the ranks' inputs in rank order, up to rounding; the same bits on
  every rank;
- bytes: what `dist.all_reduce` books for the same call (the ring's 2(n-1)/n S per rank,
  `dist.all_reduce_bytes`), and traffic only between ring neighbours;
- deadlock: the launch must finish (minipar.distributed turns a hang into a DeadlockError);
- time: the simulated clock of `dist.all_reduce` (a warning only when slower).

When the values are wrong, the checker runs the failing case again with every message
recorded and names the first one that differs from the algorithm's: its phase
(reduce-scatter or all-gather), step, the chunk index sent and the ranks summed into it,
against the chunk and the ranks expected (`_first_wrong_message`).

The grader runs these checks once more itself, every rank in a process of its own with
only its own input (`check_in_rank_processes`). This module is long because the
diagnosis of a wrong value, which message first went wrong, sits next to the checks.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import types
from dataclasses import dataclass

import numpy as np

from minipar import distributed as dist
from minipar.distributed import DeadlockError

from .harness import (
    CheckFailed,
    CheckWarning,
    expect,
    start_report,
)
from .rank_processes import RankProcesses
from .source_check import check_building_blocks

NUMBER, TITLE = "01", "ring all-reduce from send/recv"
# The check of the file's text, which the grader also runs on its own copy (grader.py).
BUILDING_BLOCKS = "uses only send / recv / isend / irecv"

FORBIDDEN = {name: "a ready-made collective; build the ring from send/recv/isend/irecv"
             for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                          "ring_all_reduce", "ring_all_gather", "ring_reduce_scatter",
                          "minipar.distributed.ring", "minipar.distributed.collectives")}

DEADLOCK_HINT = ("a blocking send waits until its receiver posts the matching recv; if every "
                 "rank sends first, nobody gets to its recv. Post the send with "
                 "`request = dist.isend(...)`, then `dist.recv(...)`, then `request.wait()` "
                 "(or alternate the order of send and recv by rank).")

SHAPE_HINT = ("here the chunks differ in length ({lengths}), so a shape error usually means "
              "a received chunk was added into, or put in place of, a chunk with another "
              "index. In reduce-scatter step s position i sends chunk (i - s) mod n and "
              "receives chunk (i - s - 1) mod n; in all-gather step s it sends chunk "
              "(i + 1 - s) mod n and receives chunk (i - s) mod n.")

PEER_HINT = ("on a sub-group, peers of send/recv are still global ranks: take them from "
             "ring_neighbours(group)")

# minipar.distributed's refusals of a peer (p2p._setup), and NumPy's of a shape
PEER_ERRORS = ("must both be in", "to/from itself", "is outside the world")
SHAPE_ERRORS = ("broadcast", "shape")


@dataclass(frozen=True)
class Case:
    """One launch: `world` ranks; `groups` None (the world) or lists of ranks."""

    world: int
    shape: tuple[int, ...]
    dtype: type = np.float64
    groups: tuple[tuple[int, ...], ...] | None = None

    def members(self, rank: int) -> tuple[int, ...]:
        if self.groups is None:
            return tuple(range(self.world))
        return next(g for g in self.groups if rank in g)

    def __str__(self) -> str:
        where = f"n={self.world}" if self.groups is None else (
            f"world of {self.world}, groups {[list(g) for g in self.groups]}")
        return f"{where}, shape {self.shape}, {np.dtype(self.dtype).name}"


CASES = (
    Case(2, (8,)),
    Case(3, (3, 5)),
    Case(4, (19,)),  # uneven chunks: 5, 5, 5, 4 elements
    Case(4, (2,)),  # fewer elements than ranks: two chunks are empty
    Case(4, (4, 4), np.float32),
    Case(4, (6,), np.float64, ((0, 2), (1, 3))),  # two rings at once; peers are global ranks
)


@dataclass
class Run:
    case: Case
    inputs: np.ndarray  # (world, *shape)
    results: list  # (returned array, x after the call) per rank
    devices: list


def _inputs(case: Case, seed: int, secret: int | None = None) -> np.ndarray:
    key = [seed, case.world, int(np.prod(case.shape))]
    rng = np.random.default_rng(key if secret is None else [secret, *key])
    return rng.standard_normal((case.world, *case.shape)).astype(case.dtype)


def _program(all_reduce, case: Case, inputs: np.ndarray):
    rank = dist.get_rank()
    group = None if case.groups is None else dist.new_group(case.members(rank), kind="dp")
    x = inputs[rank].copy()
    out = all_reduce(x, group=group)
    return out, x


def _launch(all_reduce, case: Case, inputs: np.ndarray):
    return dist.launch(_program, case.world, all_reduce, case, inputs, return_devices=True)


# ------------------------------------------------------------------ the checks
def check_runs(impl, secret: int | None = None) -> list[Run]:
    runs = []
    for index, case in enumerate(CASES):
        inputs = _inputs(case, index, secret)
        try:
            results, devices = _launch(impl.ring_all_reduce, case, inputs)
        except DeadlockError as error:
            raise CheckFailed(f"{case}: {error}\n  hint: {DEADLOCK_HINT}") from None
        except Exception as error:  # noqa: BLE001 - say which case broke, then the error
            error.add_note(f"(case {case})")
            hint = _hint(case, error)
            if hint:
                error.add_note(f"hint: {hint}")
            raise
        runs.append(Run(case, inputs, results, devices))
    return runs


def _hint(case: Case, error: Exception) -> str:
    """The hint whose cause is what happened, or "": a peer refused on a sub-group (ring
    positions used as ranks), or a shape error where the chunks differ in length (a wrong
    chunk index). Each ValueError has one cause; another hint would send the student
    after a mistake they did not make."""
    if not isinstance(error, ValueError):
        return ""
    message = str(error)
    if any(text in message for text in PEER_ERRORS):
        return PEER_HINT if case.groups is not None else ""
    n = len(case.members(0))
    lengths = [len(c) for c in np.array_split(np.arange(int(np.prod(case.shape))), n)]
    if any(text in message for text in SHAPE_ERRORS) and len(set(lengths)) > 1:
        return SHAPE_HINT.format(lengths=", ".join(map(str, lengths)))
    return ""


def check_result_form(runs: list[Run]) -> None:
    for run in runs:
        for rank, (out, x) in enumerate(run.results):
            expect(isinstance(out, np.ndarray),
                   f"{run.case}: rank {rank} returned {type(out).__name__}, not an ndarray")
            expect(out.shape == run.case.shape and out.dtype == run.inputs.dtype,
                   f"{run.case}: rank {rank} returned shape {out.shape} {out.dtype}, expected "
                   f"x's shape {run.case.shape} and dtype {run.inputs.dtype}")
            expect(np.array_equal(x, run.inputs[rank]),
                   f"{run.case}: rank {rank}'s input x was changed by the call: copy the "
                   "chunks (np.array_split returns views of x) before adding into them")


def check_values(impl, runs: list[Run]) -> None:
    for run in runs:
        rtol = 1e-5 if run.inputs.dtype == np.float32 else 1e-12
        for rank, (out, _) in enumerate(run.results):
            members = run.case.members(rank)
            expected = np.sum(run.inputs[list(members)].astype(np.float64), axis=0)
            if not np.allclose(out, expected, rtol=rtol, atol=rtol):
                diff = np.abs(out.astype(np.float64) - expected)
                index = np.unravel_index(int(np.argmax(diff)), diff.shape)
                hint = ""
                for k, r in enumerate(members):
                    if np.allclose(out, run.inputs[r], rtol=rtol):
                        hint = f" (it equals rank {r}'s own input: nothing was added)"
                    elif k and np.allclose(out, expected - run.inputs[r], rtol=rtol):
                        hint = f" (rank {r}'s contribution is missing)"
                raise CheckFailed(
                    f"{run.case}: values differ from np.sum over ranks {list(members)} at "
                    f"rank {rank}: max abs diff {diff[index]:.3g} at index "
                    f"{tuple(int(i) for i in index)}{hint}"
                    f"{_first_wrong_message(impl, run)}")


# ------------------------------------------------------------------ which message is wrong
@contextlib.contextmanager
def _recording_sends():
    """While active, every dist.send / dist.isend appends (rank, copy of the array) to the
    list it yields. The checker wraps the module attributes the student's code calls
    (`dist.isend(...)`), only for a diagnostic re-run."""
    sent, lock = [], threading.Lock()
    originals = {name: getattr(dist, name) for name in ("send", "isend")}

    def wrap(original):
        def recorded(x, dst, *args, **kwargs):
            with lock:
                sent.append((dist.get_rank(), np.array(x, copy=True)))
            return original(x, dst, *args, **kwargs)
        return recorded

    for name, original in originals.items():
        setattr(dist, name, wrap(original))
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _contents(message: np.ndarray, run: Run, members: tuple[int, ...]):
    """(chunk index k, ranks summed into it) if `message` is chunk k of the sum of some of
    the members' inputs, else None. Solved by least squares over the members' chunk k;
    decided only when a chunk has at least n elements (else the answer is ambiguous)."""
    n = len(members)
    flat = run.inputs[list(members)].reshape(n, -1).astype(np.float64)
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(flat.shape[1]), n)])
    message = np.asarray(message, np.float64).reshape(-1)
    for k in range(n):
        part = flat[:, bounds[k]:bounds[k + 1]]
        if part.shape[1] != message.size or message.size < n:
            continue
        weights = np.linalg.lstsq(part.T, message, rcond=None)[0]
        if (np.allclose(part.T @ weights, message, rtol=1e-5, atol=1e-6)
                and np.allclose(weights, np.round(weights), atol=1e-4)
                and set(np.round(weights).astype(int)) <= {0, 1}):
            return k, [members[j] for j in np.flatnonzero(np.round(weights))]
    return None


def _expected_message(step: int, i: int, members: tuple[int, ...]):
    """(phase, step within it, chunk index, ranks summed) of message `step` of position i."""
    n = len(members)
    if step < n - 1:  # reduce-scatter step s: chunk (i - s) mod n, summed over i - s .. i
        return "reduce-scatter", step, (i - step) % n, sorted(
            members[(i - j) % n] for j in range(step + 1))
    s = step - (n - 1)  # all-gather step s: the complete chunk (i + 1 - s) mod n
    return "all-gather", s, (i + 1 - s) % n, list(members)


RULES = {"reduce-scatter": "in reduce-scatter step s, position i sends chunk (i - s) mod n "
                           "and adds the chunk it receives, (i - s - 1) mod n, into its own "
                           "copy of that same chunk",
         "all-gather": "after the reduce-scatter, position i holds the complete chunk "
                       "(i + 1) mod n; in all-gather step s it sends chunk (i + 1 - s) mod n "
                       "and puts the chunk it receives, (i - s) mod n, in place of its copy"}


def _first_wrong_message(impl, run: Run) -> str:
    """"\n  first wrong message: ..." naming the phase, step and chunk index, or "" when
    the messages cannot be read (tiny chunks, or a re-run that fails differently)."""
    with _recording_sends() as sent:
        try:
            _launch(impl.ring_all_reduce, run.case, run.inputs)
        except Exception:  # noqa: BLE001 - a diagnosis only; the check already failed
            pass
    per_rank: dict[int, list] = {}
    for rank, message in sent:
        per_rank.setdefault(rank, []).append(message)
    ranks = sorted(per_rank)
    longest = max((len(v) for v in per_rank.values()), default=0)
    for step in range(longest):  # in step order: the first wrong message is the cause
        for rank in ranks:
            if step >= len(per_rank[rank]):
                continue
            members = run.case.members(rank)
            if step >= 2 * (len(members) - 1):
                continue
            found = _contents(per_rank[rank][step], run, members)
            if found is None:
                return ""
            phase, s, chunk, summed = _expected_message(step, members.index(rank), members)
            if found == (chunk, summed):
                continue
            k, got = found
            what = ("complete" if len(got) == len(members) else f"summed over ranks {got}")
            lacking = sorted(set(summed) - set(got))
            cause = (f" (right chunk, but rank {', '.join(map(str, lacking))}'s contribution "
                     "was not added into it)" if k == chunk and lacking else "")
            return (f"\n  first wrong message: {phase} step {s}, rank {rank} sent chunk {k} "
                    f"{what}; expected chunk {chunk} "
                    f"{'complete' if phase == 'all-gather' else f'summed over ranks {summed}'}"
                    f"{cause}\n  rule: {RULES[phase]}")
    return ""


def check_identical(runs: list[Run]) -> None:
    for run in runs:
        for rank, (out, _) in enumerate(run.results):
            first = run.case.members(rank)[0]
            expect(np.array_equal(out, run.results[first][0]),
                   f"{run.case}: rank {rank}'s result is not bit-identical to rank "
                   f"{first}'s: in a ring every rank ends with copies of the same reduced "
                   "chunks (the all-gather phase passes them on unchanged)")


def check_traffic_pattern(runs: list[Run]) -> None:
    for run in runs:
        matrix = dist.traffic_matrix([d.comm for d in run.devices])
        for rank, device in enumerate(run.devices):
            ops = sorted({record.op for record in device.comm.records} - {"send", "recv"})
            expect(not ops, f"{run.case}: rank {rank} called {', '.join(ops)}; a ring uses "
                            "send/recv only")
            members = run.case.members(rank)
            i, n = members.index(rank), len(members)
            neighbours = {members[(i + 1) % n], members[(i - 1) % n]}
            peers = sorted(int(p) for p in np.flatnonzero(matrix[rank]))
            expect(set(peers) <= neighbours and len(peers) <= 1,
                   f"{run.case}: rank {rank} sent to ranks {peers}; in a ring every rank "
                   f"sends to one neighbour only (its successor {members[(i + 1) % n]})")


def check_bytes(runs: list[Run]) -> None:
    for run in runs:
        shape, itemsize = run.case.shape, run.inputs.dtype.itemsize
        numel = int(np.prod(shape))
        size = numel * itemsize
        groups = run.case.groups or (tuple(range(run.case.world)),)
        for members in groups:
            n = len(members)
            booked = [dist.all_reduce_bytes(numel, itemsize, n, i) for i in range(n)]
            sent = [run.devices[r].comm.sent_bytes for r in members]
            received = [run.devices[r].comm.recv_bytes for r in members]
            formula = (f"2(n-1)/n*S = 2*{n - 1}/{n}*{size} = {2 * (n - 1) * size // n}"
                       if numel % n == 0 else "2(n-1)/n*S")
            if numel % n == 0:
                for i, r in enumerate(members):
                    expect(sent[i] == booked[i][0] and received[i] == booked[i][1],
                           f"{run.case}: rank {r} sent {sent[i]} and received {received[i]} "
                           f"bytes; a ring all-reduce sends and receives {formula} bytes "
                           f"(n={n}, S={size} bytes), as dist.all_reduce books")
            else:
                # Uneven chunks: per-rank bytes depend on which chunk a rank owns, but every
                # chunk goes around the ring twice (n-1 hops each way): 2(n-1) S in all.
                total = sum(b[0] for b in booked)
                expect(sum(sent) == total and sum(received) == total,
                       f"{run.case}: the ranks sent {sum(sent)} bytes in total; a ring "
                       f"all-reduce sends 2(n-1)*S = {total} in total (n={n}, S={size} bytes): "
                       "each chunk travels n-1 hops to be reduced and n-1 more to be shared")


def check_time(impl, runs: list[Run]) -> str:
    slowest = 1.0
    for run in runs:
        numel = int(np.prod(run.case.shape))
        if any(numel % len(g) for g in (run.case.groups or (range(run.case.world),))):
            continue  # with uneven chunks the ring's time depends on the chunk order
        _, builtin = _launch(lambda x, group: dist.all_reduce(x, group=group), run.case,
                             run.inputs)
        for mine, nccl in zip(run.devices, builtin, strict=True):
            slowest = max(slowest, mine.clock.now / nccl.clock.now)
    if slowest > 1 + 1e-9:
        raise CheckWarning(
            f"correct, but {slowest:.2f}x the simulated time of dist.all_reduce: in each step "
            "every rank should send and receive at the same time (isend, recv, wait), so the "
            "n transfers of a step overlap")
    return ""


def check(impl, *, show_traceback: bool = False):
    return _check(impl, show_traceback)


def check_in_rank_processes(path: str, *, spawn: dict, show_traceback: bool = False):
    """`check` on the file at `path` with every rank in a process of its own that holds
    only its own input, drawn from a secret seed (rank_processes.py; spawn: its env and
    cwd). A rank's result must then come from the messages it received: ranks that share
    their inputs in memory, or recompute them from the checker's seeds, fail here."""
    with RankProcesses(path, max(case.world for case in CASES), **spawn) as ranks:
        impl = types.SimpleNamespace(__file__=path,
                                     ring_all_reduce=ranks.function("ring_all_reduce"))
        return _check(impl, show_traceback, secrets.randbits(64))


def _check(impl, show_traceback: bool, secret: int | None = None):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    runs = report.run("runs without deadlock (n = 2, 3, 4, uneven sizes, sub-groups)",
                      check_runs, impl, secret, hints={DeadlockError: DEADLOCK_HINT})
    names = ["returns a new array of x's shape and dtype, x unchanged",
             "values equal x_0 + x_1 + ... + x_{n-1} (np.sum in rank order)",
             "every rank holds the same result, bit for bit",
             "only send/recv, and only to a ring neighbour",
             "bytes: 2(n-1)/n*S per rank, what dist.all_reduce books",
             "time: as fast as dist.all_reduce on the simulated clock"]
    if runs is None:
        for name in names:
            report.skip(name, "needs the runs above")
        return report
    report.run(names[0], check_result_form, runs)
    report.run(names[1], check_values, impl, runs)
    report.run(names[2], check_identical, runs)
    report.run(names[3], check_traffic_pattern, runs)
    report.run(names[4], check_bytes, runs)
    report.run(names[5], check_time, impl, runs)
    return report
