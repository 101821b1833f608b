"""Run an exercise's checker: one command per exercise, from the repository's root.

    python -m exercises.check                    # list the exercises
    python -m exercises.check 01                 # check exercises/ex01_ring_allreduce.py
    python -m exercises.check ring_allreduce     # the same, by name
    python -m exercises.check all                # every exercise
    python -m exercises.check 01 --solution      # check the reference solution (teachers)
    python -m exercises.check 01 --file hand-ins/alice/ex01_ring_allreduce.py
    python exercises/check.py 01                 # works too

Exit status: 0 when every check passes, 1 when one fails or a stub is still a stub (or
the file under test does not import, loops at import, or calls sys.exit), 2 for a
command-line mistake (one line on stderr), 130 when the user stops it with Ctrl-C.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `exercises` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exercises.checkers import EXERCISES, Exercise, find  # noqa: E402
from exercises.checkers.harness import CHECK_TIMEOUT, Outcome, Report, exit_text  # noqa: E402
from minipar.cli import OneLineParser  # noqa: E402  (one-line errors, flags spelled out)

HERE = Path(__file__).resolve().parent
PROG = "python -m exercises.check"
# Seconds the file under test may take to import (its module-level code): the exercises'
# files import in milliseconds, so a loop at module level is reported, not waited for;
# 30 s, not the checks' 10, leaves room for a hand-in that imports a heavy library on a
# cold classroom machine.
IMPORT_TIMEOUT = 3 * CHECK_TIMEOUT


class UnusableFile(FileNotFoundError):  # (callers caught FileNotFoundError before)
    """--file names something that cannot be checked: missing, a directory, not .py, or
    the solutions are not in this copy (a command-line mistake: exit status 2)."""


class ImportTimeout(Exception):
    """The file under test did not finish importing within IMPORT_TIMEOUT seconds."""


class _StopImport(BaseException):  # a BaseException: `except Exception` cannot keep it
    """Raised into an import thread that ran out of time (see _import_with_timeout)."""


def _import_with_timeout(load, where: str):
    """(module, None), or (None, the exception the file raised while importing, whatever
    its kind: SystemExit and KeyboardInterrupt included). load() runs in a daemon thread:
    after IMPORT_TIMEOUT seconds raise ImportTimeout, after trying to stop the thread
    (an exception raised into it; one stuck in a long C call, or catching everything,
    runs on as a daemon thread, which dies with the interpreter). A Ctrl-C while waiting
    reaches the main thread: it is the user's and stops the checker."""
    result: dict = {}

    def target():
        try:
            result["module"] = load()
        except _StopImport:
            pass
        except BaseException as error:  # noqa: BLE001 - whatever the file raised is a result
            result["error"] = error

    thread = threading.Thread(target=target, name=f"import {where}", daemon=True)
    thread.start()
    thread.join(IMPORT_TIMEOUT)
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(_StopImport))
        thread.join(0.5)
        raise ImportTimeout(f"importing {where} did not finish in {IMPORT_TIMEOUT:g} s: is "
                            "there a loop or a long computation at module level?")
    return result.get("module"), result.get("error")


def _where(exercise: Exercise, solution: bool, file: str | None) -> str:
    return file or f"exercises/{'solutions/' if solution else ''}{exercise.module}.py"


def _import_line(error: BaseException, where: str):
    """The line of the file under test where importing it raised `error` (its deepest
    frame in that file; a SyntaxError's own line), else the deepest frame's, else "?"."""
    if getattr(error, "lineno", None):
        return error.lineno
    frames = traceback.extract_tb(error.__traceback__)
    path = (HERE.parent / where).resolve()  # (an absolute `where` stays itself)
    mine = [f for f in frames if Path(f.filename).resolve() == path]
    return (mine or frames)[-1].lineno if frames else "?"


def _load(exercise: Exercise, solution: bool, file: str | None):
    """(module, None) or (None, what importing it raised); UnusableFile, ImportTimeout."""
    where = _where(exercise, solution, file)
    if file is not None:
        path = Path(file).resolve()
        if path.is_dir():
            raise UnusableFile(f"{file} is a directory: give the .py file")
        if not path.is_file():
            raise UnusableFile(f"--file {file}: no such file")
        if path.suffix.lower() != ".py":
            raise UnusableFile(f"{file} is not a Python file (.py)")
        name = f"handed_in_{exercise.module}"
        # An explicit loader: a hand-in saved as .PY is Python too.
        spec = importlib.util.spec_from_file_location(
            name, path, loader=importlib.machinery.SourceFileLoader(name, str(path)))
        module = importlib.util.module_from_spec(spec)

        def load():
            spec.loader.exec_module(module)
            return module

        return _import_with_timeout(load, where)
    if solution:
        if not (HERE / "solutions" / f"{exercise.module}.py").is_file():
            raise UnusableFile(
                "the reference solutions are not part of this copy of the exercises "
                "(a student handout); teachers find them in the minipar repository under "
                "exercises/solutions/")
        name = f"exercises.solutions.{exercise.module}"
    else:
        name = f"exercises.{exercise.module}"
    return _import_with_timeout(lambda: importlib.import_module(name), where)


def load_implementation(exercise: Exercise, *, solution: bool = False,
                        file: str | None = None):
    """The module under test: the student's file (default), the reference solution, or
    any file with the student file's functions. Raises what importing it raised,
    UnusableFile, or ImportTimeout (module-level code running past IMPORT_TIMEOUT)."""
    module, error = _load(exercise, solution, file)
    if error is not None:
        raise error
    return module


def check_exercise(exercise: Exercise, *, solution: bool = False, file: str | None = None,
                   show_traceback: bool = False) -> Report:
    """Load the implementation and run the exercise's checker on it. A file that does not
    even import (raises, calls sys.exit, or does not finish within IMPORT_TIMEOUT) gives
    a report with that one failure. Raises UnusableFile."""
    where = _where(exercise, solution, file)

    def failed_import(detail: str, raised: bool = False) -> Report:
        return Report(exercise.number, exercise.title, where,
                      outcomes=[Outcome("fail", "the file imports", detail, raised=raised)])

    try:
        impl, error = _load(exercise, solution, file)
    except ImportTimeout as timeout:
        return failed_import(str(timeout))
    if error is None:
        return exercise.check(impl, show_traceback=show_traceback)
    line = _import_line(error, where)
    if isinstance(error, SystemExit):  # at import: never the checker's own exit status
        detail, raised = exit_text(error, line), True
    else:  # a student's syntax error, a module-level exception, ... is a result
        detail = (f"{type(error).__name__} at line {line}: {error}" if str(error)
                  else f"{type(error).__name__} at line {line}")
        raised = False
    if show_traceback:
        detail += "\n" + "".join(traceback.format_exception(error)).rstrip()
    return failed_import(detail, raised)


def list_exercises() -> str:
    lines = ["minipar exercises (edit the student file, then run its checker):", ""]
    for e in EXERCISES:
        lines.append(f"  {e.number}  {e.title:<48} ~{e.minutes} min")
        lines.append(f"      edit   exercises/{e.module}.py")
        lines.append(f"      check  python -m exercises.check {e.number}")
    lines += ["", "Teachers: add --solution to run a checker on the reference solution."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # the user's Ctrl-C (the code under test's is a result)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = OneLineParser(
        prog=PROG,
        description="Check a minipar exercise: which checks pass, which fail and why.")
    parser.add_argument("exercises", nargs="*", metavar="EXERCISE",
                        help="number (01), name (ring_allreduce) or 'all'")
    parser.add_argument("--solution", action="store_true",
                        help="check the reference solution instead of the student file")
    parser.add_argument("--file", help="check this file instead of the student file "
                                       "(e.g. a student's hand-in; one exercise only)")
    parser.add_argument("--traceback", action="store_true",
                        help="show full tracebacks of errors in the code under test")
    parser.add_argument("--list", action="store_true", help="list the exercises")
    args = parser.parse_args(argv)

    if args.list and args.exercises:
        parser.error(f"--list takes no EXERCISE (got {' '.join(args.exercises)})")
    if args.file is not None and not args.exercises:
        parser.error("--file checks one exercise: name exactly one")
    if args.list or not args.exercises:
        print(list_exercises())
        return 0
    try:
        if args.exercises == ["all"]:
            chosen = list(EXERCISES)
        else:
            chosen = [find(key) for key in args.exercises]
    except KeyError as error:
        parser.error(error.args[0])
    if args.file is not None and len(chosen) != 1:
        parser.error("--file checks one exercise: name exactly one")
    if args.file is not None and args.solution:
        parser.error("--file and --solution exclude each other")

    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    failed = []
    for exercise in chosen:
        try:
            report = check_exercise(exercise, solution=args.solution, file=args.file,
                                    show_traceback=args.traceback)
        except UnusableFile as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
        print(report.render(color=color))
        if len(chosen) > 1:
            print()
        if not report.passed:
            failed.append(exercise.number)
    if len(chosen) > 1:
        print(f"{len(chosen) - len(failed)} of {len(chosen)} exercises pass"
              + (f"; not yet: {', '.join(failed)}" if failed else "."))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
