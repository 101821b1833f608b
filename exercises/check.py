"""Run an exercise's checker: one command per exercise, from the repository's root.

    python -m exercises.check                    # list the exercises
    python -m exercises.check 01                 # check exercises/ex01_ring_allreduce.py
    python -m exercises.check ring_allreduce     # the same, by name
    python -m exercises.check all                # every exercise
    python -m exercises.check 01 --solution      # check the reference solution (teachers)
    python -m exercises.check 01 --file hand-ins/alice/ex01_ring_allreduce.py
    python exercises/check.py 01                 # works too

Exit status: 0 when every check passes, 1 when one fails or a stub is still a stub (or
the file under test does not import, loops at import, calls sys.exit or os._exit), 2 for
a command-line mistake or a machine that cannot run the checker (no temporary folder, no
new process: one line on stderr), 130 when the user stops it with Ctrl-C. The
file under test runs only in processes of its own, so nothing it does sets the status
(exercises/checkers/grader.py; what that guarantees: docs/exercises.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `exercises` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exercises.checkers import EXERCISES, Exercise, find  # noqa: E402
from exercises.checkers.grader import GraderError, ImportTimeout, grade  # noqa: E402
from exercises.checkers.harness import CHECK_TIMEOUT, Report  # noqa: E402
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


def _import_with_timeout(load, where: str):
    """The worker's event that ends the import of the file under test: `load(seconds)`
    returns it, or None when the seconds ran out first (then ImportTimeout). The grader
    waits, not the worker: whatever the file does, it cannot stop this clock."""
    event = load(IMPORT_TIMEOUT)
    if event is None:
        raise ImportTimeout(f"importing {where} did not finish in {IMPORT_TIMEOUT:g} s: is "
                            "there a loop or a long computation at module level?")
    return event


def _where(exercise: Exercise, solution: bool, file: str | None) -> str:
    return file or f"exercises/{'solutions/' if solution else ''}{exercise.module}.py"


def _under_test(exercise: Exercise, solution: bool, file: str | None) -> tuple[Path, str]:
    """(path of the file under test, the module name it is imported as); UnusableFile."""
    if file is not None:
        path = Path(file).resolve()
        if path.is_dir():
            raise UnusableFile(f"{file} is a directory: give the .py file")
        if not path.is_file():
            raise UnusableFile(f"--file {file}: no such file")
        if path.suffix.lower() != ".py":
            raise UnusableFile(f"{file} is not a Python file (.py)")
        return path, f"handed_in_{exercise.module}"
    if solution:
        path = HERE / "solutions" / f"{exercise.module}.py"
        if not path.is_file():
            raise UnusableFile(
                "the reference solutions are not part of this copy of the exercises "
                "(a student handout); teachers find them in the minipar repository under "
                "exercises/solutions/")
        return path, f"exercises.solutions.{exercise.module}"
    return HERE / f"{exercise.module}.py", f"exercises.{exercise.module}"


def check_exercise(exercise: Exercise, *, solution: bool = False, file: str | None = None,
                   show_traceback: bool = False, echo=print) -> Report:
    """Run the exercise's checker on the student file, the reference solution or `file`,
    in processes of their own (exercises/checkers/grader.py); `echo` shows what the file
    printed. A file that does not import (raises, calls sys.exit, or does not finish
    within IMPORT_TIMEOUT) gives a report with that one failure. Raises UnusableFile,
    and GraderError when this machine cannot run the checker apart."""
    path, name = _under_test(exercise, solution, file)
    return grade(exercise, path, name, _where(exercise, solution, file),
                 wait_import=_import_with_timeout, show_traceback=show_traceback, echo=echo,
                 hand_in=file is not None)


def _echo(line: str) -> None:
    """Show a line of the file's output as it comes (stdout may be a pipe)."""
    print(line, flush=True)


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
                                    show_traceback=args.traceback, echo=_echo)
        except (UnusableFile, GraderError) as error:
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
