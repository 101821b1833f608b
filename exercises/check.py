"""Run an exercise's checker: one command per exercise, from the repository's root.

    python -m exercises.check                    # list the exercises
    python -m exercises.check 01                 # check exercises/ex01_ring_allreduce.py
    python -m exercises.check ring_allreduce     # the same, by name
    python -m exercises.check all                # every exercise
    python -m exercises.check 01 --solution      # check the reference solution (teachers)
    python -m exercises.check 01 --file hand-ins/alice/ex01_ring_allreduce.py
    python exercises/check.py 01                 # works too

Exit status: 0 when every check passes, 1 when one fails or a stub is still a stub, 2 for
a command-line mistake.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `exercises` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exercises.checkers import EXERCISES, Exercise, find  # noqa: E402
from exercises.checkers.harness import Outcome, Report  # noqa: E402

HERE = Path(__file__).resolve().parent


def load_implementation(exercise: Exercise, *, solution: bool = False,
                        file: str | None = None):
    """The module under test: the student's file (default), the reference solution, or
    any file with the student file's functions."""
    if file is not None:
        path = Path(file).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--file {file}: no such file")
        spec = importlib.util.spec_from_file_location(f"handed_in_{exercise.module}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if solution:
        if not (HERE / "solutions" / f"{exercise.module}.py").is_file():
            raise FileNotFoundError(
                "the reference solutions are not part of this copy of the exercises "
                "(a student handout); teachers find them in the minipar repository under "
                "exercises/solutions/")
        return importlib.import_module(f"exercises.solutions.{exercise.module}")
    return importlib.import_module(f"exercises.{exercise.module}")


def check_exercise(exercise: Exercise, *, solution: bool = False, file: str | None = None,
                   show_traceback: bool = False) -> Report:
    """Load the implementation and run the exercise's checker on it. A file that does not
    even import gives a report with that one failure."""
    try:
        impl = load_implementation(exercise, solution=solution, file=file)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - a student's syntax error is a result
        where = file or f"exercises/{'solutions/' if solution else ''}{exercise.module}.py"
        frames = traceback.extract_tb(error.__traceback__)
        line = getattr(error, "lineno", None) or (frames[-1].lineno if frames else "?")
        detail = f"{type(error).__name__} at line {line}: {error}"
        if show_traceback:
            detail += "\n" + "".join(traceback.format_exception(error)).rstrip()
        return Report(exercise.number, exercise.title, where,
                      outcomes=[Outcome("fail", "the file imports", detail)])
    return exercise.check(impl, show_traceback=show_traceback)


def list_exercises() -> str:
    lines = ["minipar exercises (edit the student file, then run its checker):", ""]
    for e in EXERCISES:
        lines.append(f"  {e.number}  {e.title:<48} ~{e.minutes} min")
        lines.append(f"      edit   exercises/{e.module}.py")
        lines.append(f"      check  python -m exercises.check {e.number}")
    lines += ["", "Teachers: add --solution to run a checker on the reference solution."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m exercises.check",
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
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
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
