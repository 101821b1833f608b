"""Grade a file without running it here: the grader's side of every check.

    report = grade(exercise, path, name, where, wait_import=...)

The file under test never runs in the grader's process. grade()
1. reads the file once, and checks its text against the checker's FORBIDDEN and the
   rules of source_check.py (the grader's own outcome for that check);
2. copies the exercises (not the solutions) into a fresh temporary folder and starts
   worker.py there, in a session of its own; the worker confines itself (sandbox.py:
   nothing writable but its scratch folder) before it imports the checker and then the
   file, and sends the checks' outcomes back as data (wire.py). What it prints is shown,
   each line marked as the file's output;
3. waits for it under deadlines of its own (the import allowance; STARTUP_TIMEOUT,
   RUN_TIMEOUT), then kills its whole process group: a thread or a process the file left
   behind ends with it;
4. compares exercises/ and minipar/ with what they held before and puts back anything
   changed (guard.py; a failure of the file when it did: the layer that works where the
   sandbox cannot);
5. when the worker's outcomes all pass, runs the checker again here, on the file's
   functions in processes of their own (rank_processes.py): for a checker with
   `check_in_rank_processes` (01), every rank in a process of its own that holds only
   its own input; for one with FUNCTIONS (05-08, 11-13), the file's functions in one
   process. That report is the one returned. (02-04, 09 and 10 pass objects, models,
   optimizers, Parameters with hooks, to the file's code, which cannot cross a process
   boundary: their verdict is the worker's.)
The verdict is the returned Report's; exercises/check.py takes the exit status from it
alone. docs/exercises.md says what this guarantees and what it does not.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from . import guard, wire
from .harness import CHECK_TIMEOUT, LABELS, Outcome, Report
from .rank_processes import RankProcesses
from .source_check import check_building_blocks
from .worker import sign

EXERCISES = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT = 60.0  # seconds for a worker to import minipar and the checker
RUN_TIMEOUT = 12 * CHECK_TIMEOUT  # seconds for the checks, after the import
MAX_SOURCE = 1 << 20  # bytes of a file under test
MAX_OUTPUT_LINES = 200  # lines of the file's own output shown
MAX_REPORT = 1 << 22  # bytes of outcomes read from a worker
OUTPUT_MARK = "  | "
NO_LANDLOCK = ("Note: no Landlock here (it needs Linux 5.13 or later with Landlock on): "
               "the file could write wherever you can (the grader puts back only exercises/ "
               "and minipar/) and signal this process; see docs/exercises.md.")


class ImportTimeout(Exception):
    """The file under test did not finish importing within the import allowance."""


class GraderError(Exception):
    """The grader cannot run here: no temporary folder, no new process (the machine's
    fault, not the file's: exercises/check.py says it in one line)."""


def grade(exercise, path: Path, name: str, where: str, *, wait_import, show_traceback=False,
          echo=print, hand_in: bool = False) -> Report:
    """Check the file at `path` (imported as module `name`, shown as `where`) in processes
    of its own; see the module docstring. `wait_import(load, where)` waits for the import
    (exercises/check.py: load(seconds) returns the worker's next event, or None when the
    seconds ran out) and raises ImportTimeout. `echo` shows the file's output. A hand-in's
    report says so when the worker could not confine itself with Landlock."""
    if os.name != "posix":
        raise GraderError("the grader runs the file in processes of its own with POSIX pipes "
                          "and process groups: use Linux or macOS (or WSL)")
    report = Report(exercise.number, exercise.title, _shown(path, where))
    try:
        with open(path, "rb") as file:
            source = file.read(MAX_SOURCE + 1)
    except OSError as error:
        raise GraderError(f"cannot read {where}: {error.strerror}") from None
    if len(source) > MAX_SOURCE:
        report.outcomes.append(Outcome("fail", "the file imports",
                                       f"{where} is larger than {MAX_SOURCE} bytes"))
        return report
    checker = exercise.checker
    try:
        with tempfile.TemporaryDirectory(prefix="minipar-grader-") as folder:
            box = _Box(Path(folder), path.name, source)
            text = Report(exercise.number, exercise.title, where)
            text.run(checker.BUILDING_BLOCKS, check_building_blocks, box.original,
                     checker.FORBIDDEN)
            before = guard.snapshot()
            try:
                report.outcomes, held = _run_worker(box, exercise, name, where, wait_import,
                                                    show_traceback, echo)
            finally:
                changed = guard.restore(before)
            if hand_in and not any(layer.startswith("Landlock") for layer in held):
                report.remark = NO_LANDLOCK
            if changed:
                report.outcomes.append(Outcome(
                    "fail", "leaves the grader's files alone",
                    f"the file under test changed {', '.join(changed[:3])}"
                    f"{' and more' if len(changed) > 3 else ''}: put back as they were"))
            _override(report, text.outcomes)
            if report.passed and hasattr(checker, "check_in_rank_processes"):
                return _in_rank_processes(checker, box, report, show_traceback)
            if report.passed and hasattr(checker, "FUNCTIONS"):
                return _in_a_process(checker, box, report, show_traceback)
    except OSError as error:  # the temporary folder, or a new process
        raise GraderError(f"cannot run the checker in a process of its own: "
                          f"{error.strerror or error}") from None
    return report


def _in_rank_processes(checker, box: _Box, report: Report, show_traceback: bool) -> Report:
    """The checker's report with every rank in a process of its own (module docstring)."""
    isolated = checker.check_in_rank_processes(str(box.copy_for_ranks()), spawn=box.spawn(),
                                               show_traceback=show_traceback)
    isolated.target, isolated.remark = report.target, report.remark
    if not isolated.passed:
        isolated.remark = "\n".join(filter(None, [
            "It passes with the ranks as threads of one process, not with each rank in a "
            "process of its own that sees only its own input: ranks may share data only "
            "through the messages they send.", report.remark]))
    return isolated


def _in_a_process(checker, box: _Box, report: Report, show_traceback: bool) -> Report:
    """The checker's report, run here, with the file's FUNCTIONS in a process of their
    own: what the file does to the checker or to NumPy in its process changes nothing."""
    path = str(box.copy_for_ranks())
    with RankProcesses(path, 1, stand_in=False, classes=checker.CLASSES,
                       **box.spawn()) as process:
        impl = types.SimpleNamespace(__file__=path, **{name: process.function(name)
                                                        for name in checker.FUNCTIONS})
        checked = checker.check(impl, show_traceback=show_traceback)
    checked.target, checked.remark = report.target, report.remark
    if not checked.passed:
        checked.remark = "\n".join(filter(None, [
            "It passes when the checks run in the file's own process, not when the grader "
            "runs them: does the file change the checker or NumPy?", report.remark]))
    return checked


def _shown(path: Path, where: str) -> str:
    """What "checking ..." names: the path as given, relative to here when inside."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return where
    return where if relative.startswith("..") else relative


def _override(report: Report, mine: list[Outcome]) -> None:
    """Put the grader's own failures in place of the worker's outcomes of the same name
    (a failure of the worker's stays: it says more), or first when it has none."""
    for outcome in (o for o in mine if o.status == "fail"):
        same = [i for i, o in enumerate(report.outcomes) if o.name == outcome.name]
        if not same:
            report.outcomes.insert(0, outcome)
        elif report.outcomes[same[0]].status != "fail":
            report.outcomes[same[0]] = outcome


class _Box:
    """The temporary folder a grading uses: root/exercises (a copy, without solutions),
    root/under-test (the file), scratch (the only folder a worker may write),
    original (the grader's copy of the file, read before anything ran)."""

    def __init__(self, folder: Path, filename: str, source: bytes) -> None:
        self.folder, self.filename, self.source = folder, filename, source
        self.root, self.scratch = folder / "root", folder / "scratch"
        shutil.copytree(EXERCISES, self.root / "exercises", ignore=shutil.ignore_patterns(
            "solutions", "__pycache__", "*.pyc"))
        self.scratch.mkdir()
        (folder / "original").mkdir()
        self.original = types.SimpleNamespace(__file__=str(folder / "original" / filename))
        Path(self.original.__file__).write_bytes(source)  # what the text check reads
        self.under_test = self.root / "under-test" / filename
        self.under_test.parent.mkdir()
        self.under_test.write_bytes(source)

    def environment(self) -> dict:
        """The workers' environment: this copy of the exercises first on the path, then
        where this process found minipar and NumPy; temporary files in scratch."""
        paths = [str(self.root)] + [p for p in sys.path if p and os.path.isdir(p)]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONSAFEPATH": "1", "TMPDIR": str(self.scratch),
                "MPLCONFIGDIR": str(self.scratch), "MINIPAR_CACHE_DIR": "off"}

    def copy_for_ranks(self) -> Path:
        """A fresh copy of the file from what was read first, for the rank processes."""
        path = self.folder / "ranks" / self.filename
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(self.source)
        return path

    def spawn(self) -> dict:
        return {"env": self.environment(), "cwd": str(self.folder / "ranks")}


def _run_worker(box: _Box, exercise, name: str, where: str, wait_import, show_traceback,
                echo) -> tuple[list[Outcome], list[str]]:
    """The worker's outcomes (or the one failure that says why there are none), and the
    layers of the sandbox that held."""
    events_read, events_write = os.pipe()
    key_read, key_write = os.pipe()
    key = secrets.token_bytes(32)
    os.write(key_write, key)
    os.close(key_write)
    spec = {"exercise": exercise.number, "file": str(box.under_test), "name": name,
            "traceback": show_traceback, "events": events_write, "key": key_read,
            "scratch": str(box.scratch), "parent": os.getpid()}
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "exercises.checkers.worker", json.dumps(spec)],
            cwd=box.scratch, env=box.environment(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            pass_fds=(events_write, key_read), start_new_session=True)
    finally:
        os.close(events_write)
        os.close(key_read)
    worker = _Worker(process, events_read, echo, key)
    try:
        return worker.outcomes(where, wait_import), worker.held
    finally:
        worker.kill()


def _failure(detail: str, name: str = "the checks run to the end") -> list[Outcome]:
    return [Outcome("fail", name, detail)]


class _Worker:
    """A running worker: its events (wire messages) and its output, read together."""

    def __init__(self, process, events: int, echo, key: bytes) -> None:
        self.process, self.events, self.echo, self.key = process, events, echo, key
        self.reader, self.received = wire.Reader(), 0
        self.selector = selectors.DefaultSelector()
        self.selector.register(events, selectors.EVENT_READ, "events")
        self.selector.register(process.stdout, selectors.EVENT_READ, "output")
        self.pending, self.lines = b"", 0
        self.ended = False
        self.held: list[str] = []  # the sandbox's layers, as the worker said before the file

    def next_event(self, timeout: float) -> dict | None:
        """The worker's next event; {"event": "ended"} when it closed its pipe; None when
        `timeout` seconds pass first. Shows its output meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.reader.pop()
            if message is not None:
                return message[0]
            if self.ended:
                return {"event": "ended"}
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in self.selector.select(left):
                data = os.read(key.fd, 1 << 16)
                if key.data == "output":
                    self._show(data)
                elif not data:
                    self.ended = True
                else:
                    self.received += len(data)
                    if self.received > MAX_REPORT:
                        raise wire.WireError("the worker sent more than a report")
                    self.reader.feed(data)

    def _show(self, data: bytes) -> None:
        if not data:
            self.selector.unregister(self.process.stdout)
            data, self.pending = self.pending + (b"\n" if self.pending else b""), b""
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            self.lines += 1
            if self.lines == 1:
                self.echo("output of the file under test:")
            if self.lines <= MAX_OUTPUT_LINES:
                self.echo(OUTPUT_MARK + line.decode(errors="replace").rstrip("\r"))
            elif self.lines == MAX_OUTPUT_LINES + 1:
                self.echo(OUTPUT_MARK + "(more output not shown)")

    def outcomes(self, where: str, wait_import) -> list[Outcome]:
        try:
            event = self._expect("started", STARTUP_TIMEOUT)
            if event.get("event") == "started":
                self.held = [str(layer) for layer in event.get("sandbox", [])]
                event = self._expect("importing", STARTUP_TIMEOUT)
            if event.get("event") != "importing":
                return self._no_report(event, "before it imported the file")
            try:
                event = wait_import(self.next_event, where)
            except ImportTimeout as timeout:
                return _failure(str(timeout), "the file imports")
            if event.get("event") == "imported":
                event = self.next_event(RUN_TIMEOUT) or {"event": "timeout"}
            if event.get("event") != "report":
                return self._no_report(event, "before the checks finished")
            if not hmac.compare_digest(str(event.get("mac")),
                                       sign(self.key, event.get("outcomes"))):
                return _failure("the report did not come from the checker (it is not signed "
                                "with the checker's key): something in the file under test "
                                "wrote to the grader's pipe")
            return _outcomes(event)
        except wire.WireError as error:
            return _failure(f"the checker's process sent something else than a report "
                            f"({error})")

    def _expect(self, name: str, timeout: float) -> dict:
        return self.next_event(timeout) or {"event": "timeout", "waited": name}

    def _no_report(self, event: dict, when: str) -> list[Outcome]:
        if event.get("event") == "timeout" and event.get("waited"):
            return _failure(f"the checker's process did not start within "
                            f"{STARTUP_TIMEOUT:g} s (is this machine very busy?)")
        if event.get("event") == "timeout":
            return _failure(f"the checks did not finish within {RUN_TIMEOUT:g} s (a loop "
                            "that never ends, in a function the checks call directly?)")
        status = self.process.wait(timeout=5) if event.get("event") == "ended" else None
        return _failure(f"the checker's process ended {when}, with exit status {status} "
                        "and no report: did the file under test call os._exit(), or crash "
                        "the interpreter?" if status is not None else
                        f"the checker's process stopped {when} with an unexpected message")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 0.5  # show what it printed before it was killed
        with contextlib.suppress(OSError):
            while self.selector.get_map() and time.monotonic() < deadline:
                ready = self.selector.select(0)
                if not ready:
                    break
                for key, _ in ready:
                    data = os.read(key.fd, 1 << 16)
                    if key.data == "output":
                        self._show(data)
                    elif not data:
                        self.selector.unregister(key.fileobj)
        self.selector.close()
        os.close(self.events)
        self.process.stdout.close()


def _outcomes(event: dict) -> list[Outcome]:
    """The worker's outcomes as data: each field checked, nothing else trusted."""
    listed = event.get("outcomes")
    if not isinstance(listed, list) or not listed:
        raise wire.WireError("a report without outcomes")
    outcomes = []
    for item in listed:
        if not isinstance(item, dict) or item.get("status") not in LABELS \
                or not all(isinstance(item.get(k), str) for k in ("name", "detail")) \
                or not isinstance(item.get("raised"), bool):
            raise wire.WireError("an outcome that is not one")
        outcomes.append(Outcome(item["status"], item["name"], item["detail"], item["raised"]))
    return outcomes
