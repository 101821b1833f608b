"""The ranks of a check, each in a process of its own: the grader's side.

    with RankProcesses(path, world, env=..., cwd=...) as ranks:
        ring_all_reduce = ranks.function("ring_all_reduce")
        dist.launch(program, world, ring_all_reduce, ...)   # program calls it on each rank

Ranks that are threads of one process can share anything: a module-level dict gives
every rank every input while the messages they send are zeros, and the byte ledger and
the clock look exactly like a ring's. Here each rank of the file under test runs in a
process of its own (rank_process.py), confined so that the processes share no memory,
file, network or IPC (sandbox.py): what a rank knows of another's input it received in
a message.

`function(name)` stands for the file's function on a virtual rank of a launch in the
grader. Called on virtual rank r, it hands its arrays to process r, which runs the
file's function there, and performs what that process asks for (isend, irecv, wait) on
virtual rank r with minipar.distributed. So minipar matches the messages, books their
bytes and time in the launch's devices and finds deadlocks and stalls as it does when
the function runs on the thread itself; then the arguments' final contents and the
result come back. The checker runs unchanged on top (ex01_ring_allreduce.py,
check_in_rank_processes).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from minipar import distributed as dist

from . import harness, wire

IMPORT_TIMEOUT = 30.0  # seconds for a rank process to start and import the file


class RankProcessError(Exception):
    """A rank's process did not import the file, raised, ended, or broke the protocol."""


class _Rank:
    """One rank's process and its two pipes."""

    def __init__(self, path: str, env: dict, cwd: str, stand_in: bool, classes: list) -> None:
        from_grader, self.to_rank = os.pipe()
        self.from_rank, to_grader = os.pipe()
        spec = {"file": path, "name": "rank_file", "to_grader": to_grader,
                "from_grader": from_grader, "parent": os.getpid(), "stand_in": stand_in,
                "classes": classes}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "exercises.checkers.rank_process", json.dumps(spec)],
                cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=(to_grader, from_grader),
                start_new_session=True)
        finally:
            os.close(to_grader)
            os.close(from_grader)
        self.reader = wire.Reader()
        self.failure: str | None = None

    def wait_imported(self, deadline: float) -> None:
        try:
            message = wire.read(self.from_rank, self.reader,
                                timeout=max(0.0, deadline - time.monotonic()))
        except wire.WireError as error:
            message, self.failure = None, f"ended before it imported the file ({error})"
        if message is None:
            self.failure = self.failure or (f"did not import the file within "
                                            f"{IMPORT_TIMEOUT:g} s")
        elif message[0].get("event") == "import-failed":
            self.failure = f"could not import the file: {message[0].get('text')}"
        elif message[0].get("event") != "imported":
            self.failure = "sent something else than its import"

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        os.close(self.to_rank)
        os.close(self.from_rank)


class RankProcesses:
    """`world` processes, one per rank, each with the file at `path` imported (see the
    module docstring). env, cwd: those of the processes (the grader's sandbox).

    stand_in: the file sees rank_dist.py as minipar.distributed (ranks kept apart);
    without it, the real minipar (a checker of plain functions: RankProcesses(path, 1,
    stand_in=False), whose functions are then called outside any launch, in process 0).
    classes: the dataclasses a call's arguments and results may hold (wire.pack)."""

    def __init__(self, path: str, world: int, *, env: dict, cwd: str, stand_in: bool = True,
                 classes=()) -> None:
        self.path, self.world, self.env, self.cwd = path, world, env, cwd
        self.stand_in, self.classes = stand_in, {c.__name__: c for c in classes}
        self.ranks: list[_Rank] = []

    def __enter__(self) -> RankProcesses:
        names = [f"{c.__module__}:{c.__qualname__}" for c in self.classes.values()]
        try:
            self.ranks = [_Rank(self.path, self.env, self.cwd, self.stand_in, names)
                          for _ in range(self.world)]
            deadline = time.monotonic() + IMPORT_TIMEOUT
            for rank in self.ranks:
                rank.wait_imported(deadline)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
        self.ranks = []

    def function(self, name: str):
        """The file's function `name`: called on virtual rank r of a launch, it runs in
        process r (its group= passed on); called outside a launch, in process 0."""
        return functools.partial(self._call, name)

    def _call(self, name: str, *args, **kwargs):
        try:
            number, world, timeout = dist.get_rank(), dist.get_world_size(), None
        except Exception:  # noqa: BLE001 - outside a launch: a plain function, no watchdog
            number, world, timeout = 0, 1, harness.CHECK_TIMEOUT
        rank = self.ranks[number]
        if rank.failure is not None:
            raise RankProcessError(f"rank {number}'s process {rank.failure}")
        where = {}
        if "group" in kwargs:
            group = kwargs.pop("group")
            where = ({"group": None} if group is None else
                     {"group": list(group.ranks), "kind": group.kind})
        arrays = []
        self._send(rank, number, {"op": "call", "function": name, "rank": number,
                                  "world": world, "args": wire.pack(list(args), arrays,
                                                                    self.classes),
                                  **where}, arrays)
        works = {}
        while True:
            try:
                message = wire.read(rank.from_rank, rank.reader, timeout=timeout)
            except wire.WireError as error:
                rank.failure = f"ended ({error})"
                raise RankProcessError(f"rank {number}'s process {rank.failure}") from None
            if message is None:
                raise RankProcessError(f"{name}() did not return within {timeout:g} s in "
                                       "its process: a loop that never ends?")
            header, payload = message
            op = header.get("op")
            if op in ("isend", "irecv"):
                try:
                    work, peer, tag = int(header["id"]), int(header["peer"]), int(header["tag"])
                    ranks, kind = header.get("group"), header.get("kind", "other")
                    sent = payload[0] if op == "isend" else None
                except (KeyError, TypeError, ValueError, IndexError):
                    raise RankProcessError(f"rank {number}'s process sent a message the "
                                           f"grader cannot read: {header}") from None
                on = None if ranks is None else dist.new_group(ranks, kind)
                works[work] = (dist.isend(sent, peer, group=on, tag=tag) if op == "isend"
                               else dist.irecv(peer, group=on, tag=tag))
            elif op == "wait" and isinstance(header.get("id"), int) and header["id"] in works:
                received = works.pop(header["id"]).wait()
                self._send(rank, number, {"op": "done", "id": header["id"]},
                           [] if received is None else [received])
            elif op == "return":
                return self._returned(number, header, payload, args)
            elif op == "raise":
                raise RankProcessError(f"rank {number}'s process: {header.get('text')}")
            else:
                raise RankProcessError(f"rank {number}'s process sent {op!r} out of turn")

    def _returned(self, number: int, header: dict, payload: list, args: tuple):
        """The result; the arrays passed in get their final contents (as on a thread)."""
        try:
            value = wire.unpack(header.get("value"), payload, self.classes)
            final = wire.unpack(header.get("args"), payload, self.classes)
        except (wire.WireError, TypeError, ValueError, RecursionError) as error:
            raise RankProcessError(f"rank {number}'s process returned what the grader "
                                   f"cannot read ({error})") from None
        if isinstance(final, list) and len(final) == len(args):
            for argument, after in zip(args, final, strict=True):
                if isinstance(argument, np.ndarray) and isinstance(after, np.ndarray) \
                        and argument.shape == after.shape and argument.flags.writeable:
                    np.copyto(argument, after, casting="unsafe")
        return value

    @staticmethod
    def _send(rank: _Rank, number: int, header: dict, arrays) -> None:
        try:
            wire.write(rank.to_rank, header, arrays)
        except OSError as error:
            rank.failure = f"ended ({error})"
            raise RankProcessError(f"rank {number}'s process {rank.failure}") from None
