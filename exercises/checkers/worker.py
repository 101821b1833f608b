"""The process in which a checker runs the file under test (started by grader.py).

    python -m exercises.checkers.worker SPEC      # SPEC: JSON from grader.py

It confines itself first (sandbox.py), while it has one thread and before anything of
the file under test exists; reads the key that signs its report; tells the grader what
held; imports the checker (and with it minipar), then the file under test; runs the
checks and sends their outcomes to the grader as data, signed, on a pipe of their own
(wire.py). The grader decides the verdict and the exit status: nothing this process
prints, raises or exits with is either.
"""

from __future__ import annotations

import hmac
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from exercises.checkers import sandbox
from exercises.checkers.import_failures import import_failure

HERE = Path(__file__).resolve().parents[1]  # the exercises/ folder


def import_file(path, name: str):
    """(module, None) or (None, what importing the file raised, whatever its kind:
    SystemExit and KeyboardInterrupt included)."""
    # An explicit loader: a hand-in saved as .PY is Python too.
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.SourceFileLoader(name, str(path)))
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # noqa: BLE001 - whatever the file raised is a result
        return None, error
    return module, None


def load_implementation(exercise, *, solution: bool = False, file: str | None = None):
    """The module under test imported into this process: the student's file (default),
    the reference solution, or `file`. Raises what importing it raised. (The grader
    never calls this: a file under test runs only in a process of its own.)"""
    if file is not None:
        path, name = Path(file), f"handed_in_{exercise.module}"
    elif solution:
        path = HERE / "solutions" / f"{exercise.module}.py"
        name = f"exercises.solutions.{exercise.module}"
    else:
        path, name = HERE / f"{exercise.module}.py", f"exercises.{exercise.module}"
    module, error = import_file(path, name)
    if error is not None:
        raise error
    return module


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    events = spec["events"]
    held = sandbox.confine([spec["scratch"]], parent=spec["parent"])
    # The key that signs the report, read and its pipe closed before the file under test
    # exists: writing to the grader's pipe is not enough to forge a report.
    key = os.read(spec["key"], 64)
    os.close(spec["key"])
    from exercises.checkers import find, wire  # NumPy's threads start after confine
    from exercises.checkers.harness import Outcome

    wire.write(events, {"event": "started", "sandbox": held})
    exercise = find(spec["exercise"])
    checker = exercise.checker  # minipar and the checker, before the file under test
    wire.write(events, {"event": "importing"})
    module, error = import_file(spec["file"], spec["name"])
    if error is None:
        wire.write(events, {"event": "imported"})
        outcomes = checker.check(module, show_traceback=spec["traceback"]).outcomes
    else:
        detail, raised = import_failure(error, spec["file"], spec["traceback"])
        outcomes = [Outcome("fail", "the file imports", detail, raised=raised)]
    listed = [asdict(o) for o in outcomes]
    wire.write(events, {"event": "report", "outcomes": listed, "mac": sign(key, listed)})
    return 0


def sign(key: bytes, outcomes: list) -> str:
    """HMAC-SHA256 of the outcomes as JSON (the grader computes it again)."""
    return hmac.new(key, json.dumps(outcomes, sort_keys=True).encode(), "sha256").hexdigest()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
