"""What every checker shares: run one check, turn what went wrong into a sentence a student
can act on, and print the report.

A checker is a function `check(impl) -> Report`. `impl` is the implementation under test:
the student's module, the reference solution, or any object with the same attributes.
Each check is a small function that returns normally when it passes and raises
`CheckFailed("what is wrong and why")` when it does not; `Report.run` also turns the
errors the code under test raises into such sentences:

    NotImplementedError raised in the student's file   TODO: that function is still a stub
                                                        (later checks are skipped)
    minipar.distributed.DeadlockError                   FAIL with the wait-for graph + a hint
    minipar.distributed.LaunchTimeoutError              FAIL naming the student's function
                                                        that did not return, and where
    an exception raised in the code under test          ERROR "your code raised X (while
                                                        checking: ...)", its line and rank
    SystemExit (sys.exit) from the code under test      ERROR "the file under test called
                                                        sys.exit(0) (at line N)": never the
                                                        checker's exit, whatever the code
    KeyboardInterrupt raised by the code under test     ERROR, like any other exception; a
                                                        real Ctrl-C (SIGINT) of the user
                                                        still stops the checker
    any other exception                                 FAIL naming the file, line and rank

A check may add notes to an error it lets through (`error.add_note(...)`): "(case ...)"
is shown after the error's line, a note starting "hint:" after the rank, like `hints`.
Give a hint only when its cause is what happened (`hints` match the exception's type:
keep them for types that have one cause, e.g. DeadlockError).

Every check runs under `dist.launch_timeout(CHECK_TIMEOUT)`: the exercises' launches take
milliseconds, so a student's infinite loop is stopped after CHECK_TIMEOUT seconds instead
of hanging the checker (minipar's own default, 600 s, is for real training runs).
The grader (grader.py) runs all this in a process of its own, never in its own: it
waits at most IMPORT_TIMEOUT (exercises/check.py, 3 x CHECK_TIMEOUT) for the import, so
a loop at module level does not hang it either, and `os._exit` or a thread left running
ends only that process.

The student thus sees a list of checks, never a wall of traceback (`--traceback` shows it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import traceback
from dataclasses import dataclass, field

import numpy as np

import minipar
from minipar import distributed as dist
from minipar.distributed import CollectiveMismatchError, DeadlockError, LaunchTimeoutError

from .import_failures import exit_text

CHECK_TIMEOUT = 10.0  # seconds a check's launch may wait or stall (every one takes < 1 s)


class CheckFailed(Exception):
    """A check did not pass; the message says what was expected and what came out."""


class CheckWarning(Exception):
    """The result is right but something is worth a remark (reported as "warn", which
    does not fail the exercise)."""



def scale_factor(got, base, rtol: float = 1e-9, atol: float = 1e-14) -> float | None:
    """c if got = c * base (a wrong constant factor: a sum instead of a mean, a missing
    1/A), else None; what the checkers use to say "off by a factor of N"."""
    norm = float(np.vdot(base, base))
    if norm == 0:
        return None
    c = float(np.vdot(got, base)) / norm
    return c if np.allclose(got, c * base, rtol=rtol, atol=atol) else None


def expect(condition: bool, message: str) -> None:
    """Raise CheckFailed(message) unless `condition` holds."""
    if not condition:
        raise CheckFailed(message)


@dataclass
class Outcome:
    status: str  # "pass" | "fail" | "todo" | "warn" | "skip"
    name: str
    detail: str = ""
    # A failure because the code under test raised (not because a check found a wrong
    # number): shown as ERROR, so "runs without deadlock" never labels a ValueError.
    raised: bool = False


LABELS = {"pass": "ok", "fail": "FAIL", "todo": "TODO", "warn": "warn", "skip": "skip"}
COLORS = {"pass": "32", "fail": "31", "todo": "33", "warn": "33", "skip": "2"}


@dataclass
class Report:
    """The outcomes of one exercise's checks, in order."""

    number: str
    title: str
    target: str  # what was checked, e.g. "exercises/ex01_ring_allreduce.py"
    impl_file: str | None = None
    show_traceback: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    remark: str = ""  # a paragraph shown before the last line (the grader's, see grader.py)

    # -------------------------------------------------------------- running checks
    def run(self, name: str, check, *args, hints: dict | None = None):
        """Run `check(*args)` as the check called `name`; return what it returns (None if
        it failed or hit a stub)."""
        try:
            with _ctrl_c_watched() as ctrl_c, dist.launch_timeout(CHECK_TIMEOUT):
                result = check(*args)
        except KeyboardInterrupt as error:
            if ctrl_c.pressed:
                raise  # the user's Ctrl-C: stop checking
            self.outcomes.append(self._failure(name, error, hints))  # the code's raise
        except SystemExit as error:  # never the checker's exit: exit 0 means "all pass"
            self.outcomes.append(self._failure(name, error, hints))
        except CheckFailed as failure:
            self.outcomes.append(Outcome("fail", name, str(failure)))
        except CheckWarning as remark:
            self.outcomes.append(Outcome("warn", name, str(remark)))
        except NotImplementedError as error:
            todo = self._stub(error)
            if todo is None:
                self.outcomes.append(self._failure(name, error, hints))
            else:
                self.outcomes.append(Outcome("todo", name, todo))
        except Exception as error:  # noqa: BLE001 - any error of the code under test is a result
            self.outcomes.append(self._failure(name, error, hints))
        else:
            self.outcomes.append(Outcome("pass", name, result if isinstance(result, str)
                                         else ""))
            return result
        return None

    def skip(self, name: str, reason: str) -> None:
        """A check that cannot run because one it depends on failed (counts as not passed)."""
        if self.not_implemented:
            reason = "skipped until the TODO above is done"
        self.outcomes.append(Outcome("skip", name, reason))

    # -------------------------------------------------------------- results
    @property
    def not_implemented(self) -> bool:
        return any(o.status == "todo" for o in self.outcomes)

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(o.status in ("pass", "warn") for o in self.outcomes)

    def counts(self) -> tuple[int, int]:
        """(checks passed, with or without a warning; all checks, skipped ones included)."""
        return sum(o.status in ("pass", "warn") for o in self.outcomes), len(self.outcomes)

    def render(self, color: bool = False) -> str:
        def paint(status: str, text: str) -> str:
            return f"\033[{COLORS[status]}m{text}\033[0m" if color else text

        lines = [f"Exercise {self.number}: {self.title}", f"checking {self.target}", ""]
        for outcome in self.outcomes:
            label = paint(outcome.status,
                          f"{'ERROR' if outcome.raised else LABELS[outcome.status]:<5}")
            if outcome.status == "skip":  # one line: the reason is the same for all
                lines.append(f"  {label} {outcome.name} ({outcome.detail})")
                continue
            lines.append(f"  {label} {outcome.name}")
            for detail in outcome.detail.splitlines():
                lines.append(f"        {detail}")
        passed, total = self.counts()
        lines.append("")
        if self.remark:
            lines += [self.remark, ""]
        if self.passed:
            warned = sum(o.status == "warn" for o in self.outcomes)
            remark = f" ({warned} with a warning)" if warned else ""
            lines.append(paint("pass", f"All {total} checks pass{remark}."))
        elif self.not_implemented:
            stubs = []
            for outcome in self.outcomes:
                stub = outcome.detail.split(" ", 1)[0]
                if outcome.status == "todo" and stub not in stubs:
                    stubs.append(stub)
            lines.append(paint("todo", f"{passed} of {total} checks pass; still to write: "
                                       f"{', '.join(stubs)}"))
        else:
            # Name the labels the student sees: a report whose only problem reads ERROR
            # has no FAIL to look for.
            failed = sum(o.status == "fail" and not o.raised for o in self.outcomes)
            errors = sum(o.status == "fail" and o.raised for o in self.outcomes)
            kinds = [(n, label) for n, label in ((failed, "FAIL"), (errors, "ERROR")) if n]
            kinds = kinds or [(0, "FAIL")]  # (only skips: cannot happen after a run)
            counts = ", ".join(f"{n} {'fail' if label == 'FAIL' else label}"
                               for n, label in kinds)
            first = " or ".join(label for _, label in kinds)
            lines.append(paint("fail", f"{passed} of {total} checks pass, {counts}. "
                                       f"Fix the first {first} above and run the checker "
                                       "again."))
        return "\n".join(lines)

    # -------------------------------------------------------------- errors -> sentences
    def _failure(self, name: str, error: BaseException, hints: dict | None) -> Outcome:
        """The outcome of a check stopped by `error`: an ERROR under its own label when the
        code under test raised it (the check's name then says only what was running)."""
        detail = self._describe(error, hints)
        if isinstance(error, (DeadlockError, CollectiveMismatchError, LaunchTimeoutError)):
            return Outcome("fail", name, detail)  # the checks' own subject: a sentence
        if self._student_frame(error) is None:
            return Outcome("fail", name, detail)
        return Outcome("fail", f"your code raised {type(error).__name__} (while checking: "
                               f"{name})", detail, raised=True)

    def _student_frame(self, error: BaseException):
        """The deepest traceback frame in the code under test, or None. Without a file
        (an object passed in), the deepest frame outside minipar, the checkers, the
        installed packages and the standard library."""
        frames = traceback.extract_tb(error.__traceback__)
        if self.impl_file is not None:
            mine = [f for f in frames if _same_file(f.filename, self.impl_file)]
        else:
            mine = [f for f in frames if not _library_file(f.filename)]
        return mine[-1] if mine else None

    def _stub(self, error: NotImplementedError) -> str | None:
        """"<function> in <file>:<line> still raises NotImplementedError" if the error was
        raised by the code under test itself (a stub), else None (a library limit)."""
        frames = list(traceback.walk_tb(error.__traceback__))
        if not frames:
            return None
        frame, line = frames[-1]
        filename = frame.f_code.co_filename
        if self.impl_file is not None:
            if not _same_file(filename, self.impl_file):
                return None
        elif _library_file(filename):
            return None
        # co_qualname (Python >= 3.11) says which class's forward: "g.forward" is ambiguous
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        return (f"{name}() still raises NotImplementedError "
                f"({os.path.basename(filename)}:{line}): write it, then run the checker again")

    def _describe(self, error: BaseException, hints: dict | None) -> str:
        """One paragraph: the error, where it happened (the deepest frame in the file
        under test, if any), on which rank, and an exercise-specific hint."""
        if isinstance(error, LaunchTimeoutError):
            text = _timeout_text(self, error)
        elif isinstance(error, (DeadlockError, CollectiveMismatchError)):
            text = str(error)
        elif isinstance(error, SystemExit) and self._student_frame(error) is not None:
            text = exit_text(error, self._student_frame(error).lineno)
        else:
            text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            frames = traceback.extract_tb(error.__traceback__)
            frame = self._student_frame(error) or (frames[-1] if frames else None)
            if frame is not None and not _grader_file(frame.filename):
                text += (f"\n  at {os.path.basename(frame.filename)}:{frame.lineno} in "
                         f"{frame.name}(): {frame.line}")
        notes = [note for note in getattr(error, "__notes__", ())
                 if "minipar.distributed.launch" not in note]  # the rank is said below
        for note in notes:
            if not note.startswith("hint:"):
                text += f"\n  {note}"
        rank = getattr(error, "rank", None)
        if rank is not None:
            text += f"\n  (raised on rank {rank})"
        for note in notes:  # a checker's hint (a note "hint: ...") comes last, as its own
            if note.startswith("hint:"):
                text += f"\n  {note}"
        for kind, hint in (hints or {}).items():
            if isinstance(error, kind):
                text += f"\n  hint: {hint}"
        if self.show_traceback:
            text += "\n" + "".join(traceback.format_exception(error)).rstrip()
        return text


class _CtrlC:
    pressed = False


@contextlib.contextmanager
def _ctrl_c_watched():
    """Tell the user's Ctrl-C from a KeyboardInterrupt the code under test raises: while
    the block runs, SIGINT also sets `.pressed` (then Python's handler raises as usual).
    Signals reach only the main thread; elsewhere, or when SIGINT does not raise
    KeyboardInterrupt (ignored, default action), every KeyboardInterrupt is raised by
    code."""
    ctrl_c = _CtrlC()
    previous = (signal.getsignal(signal.SIGINT)
                if threading.current_thread() is threading.main_thread() else None)
    if not callable(previous):
        yield ctrl_c
        return

    def on_sigint(signum, frame):
        ctrl_c.pressed = True
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield ctrl_c
    finally:
        signal.signal(signal.SIGINT, previous)


def _timeout_text(report: Report, error: LaunchTimeoutError) -> str:
    """"ring_all_reduce() did not return within 10 s on rank(s) 0, 1 (stuck at
    ex01_ring_allreduce.py:31: while ...)": the deepest frame of each unfinished rank's
    stack in the file under test (or, without one, outside minipar and the checkers)."""
    stuck: dict[tuple, list[int]] = {}
    for rank, stack in sorted(error.stacks.items()):
        if report.impl_file is not None:
            mine = [f for f in stack if _same_file(f.filename, report.impl_file)]
        else:
            mine = [f for f in stack if not _library_file(f.filename)]
        if mine:
            outer, deepest = mine[0], mine[-1]
            key = (outer.name, os.path.basename(deepest.filename), deepest.lineno,
                   (deepest.line or "").strip())
            stuck.setdefault(key, []).append(rank)
    lines = []
    for (name, filename, line, code), ranks in stuck.items():
        lines.append(f"{name}() did not return within {error.timeout:g} s on rank(s) "
                     f"{', '.join(map(str, ranks))} (stuck at {filename}:{line}: {code}): "
                     "a loop that never ends, or a wait nobody answers?")
    if not lines:  # stuck in minipar itself, waiting: the first line says for whom
        lines.append(str(error).splitlines()[0])
    return "\n".join(lines)


# Where a frame is not the student's: minipar, these checkers, installed packages (numpy's
# parent directory) and the standard library (os's directory).
_LIBRARY_DIRS = tuple(os.path.abspath(d) + os.sep for d in (
    os.path.dirname(minipar.__file__), os.path.dirname(__file__),
    os.path.dirname(os.path.dirname(np.__file__)), os.path.dirname(os.__file__)))


def _grader_file(filename: str) -> bool:
    """A file of the checkers: where an error is raised is no news to the student."""
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS[1])


def _library_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARY_DIRS) or filename.startswith("<")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


# ------------------------------------------------------------------ helpers for checks
def largest_difference(got, expected) -> tuple[float, tuple]:
    """(max |got - expected|, index where it is largest)."""
    diff = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    if diff.size == 0:
        return 0.0, ()
    index = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return float(diff[index]), tuple(int(i) for i in index)


def expect_close(got, expected, what: str, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """CheckFailed naming `what`, the shapes, or the largest difference."""
    got = np.asarray(got)
    expected = np.asarray(expected)
    expect(got.shape == expected.shape,
           f"{what}: shape {got.shape}, expected {expected.shape}")
    if not np.allclose(got, expected, rtol=rtol, atol=atol):
        diff, index = largest_difference(got, expected)
        raise CheckFailed(f"{what}: values differ, max abs diff {diff:.3g} at index {index} "
                          f"(got {got[index]:.6g}, expected {expected[index]:.6g})")


def start_report(number: str, title: str, impl, show_traceback: bool = False) -> Report:
    """An empty Report for checking `impl` (a module, or any object with its attributes)."""
    path = getattr(impl, "__file__", None)
    if path is not None:
        try:
            target = os.path.relpath(path)
        except ValueError:  # another drive (Windows)
            target = path
        if target.startswith(".."):
            target = path
    else:
        target = getattr(impl, "__name__", type(impl).__name__)
    return Report(number, title, target, path, show_traceback)
