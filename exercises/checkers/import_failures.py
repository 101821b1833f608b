"""How a file under test that does not import, or exits, reads in a report: one line
(no minipar here: a rank's own process uses it too, without minipar)."""

from __future__ import annotations

import traceback
from pathlib import Path


def exit_text(error: SystemExit, line) -> str:
    """"the file under test called sys.exit(0) (at line 12)" (raise SystemExit(0) reads
    the same: it is what sys.exit does)."""
    call = "sys.exit()" if error.code is None else f"sys.exit({error.code!r})"
    return f"the file under test called {call} (at line {line})"


def import_line(error: BaseException, path) -> int | str:
    """The line of the file at `path` where importing it raised `error` (its deepest
    frame in that file; a SyntaxError's own line), else the deepest frame's, else "?"."""
    if getattr(error, "lineno", None):
        return error.lineno
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if Path(f.filename).resolve() == Path(path).resolve()]
    return (mine or frames)[-1].lineno if frames else "?"


def import_failure(error: BaseException, path, show_traceback: bool = False):
    """(detail, raised) of the check "the file imports" when importing it raised `error`."""
    line = import_line(error, path)
    if isinstance(error, SystemExit):  # at import: never the checker's own exit status
        detail, raised = exit_text(error, line), True
    else:  # a student's syntax error, a module-level exception, ... is a result
        detail = (f"{type(error).__name__} at line {line}: {error}" if str(error)
                  else f"{type(error).__name__} at line {line}")
        raised = False
    if show_traceback:
        detail += "\n" + "".join(traceback.format_exception(error)).rstrip()
    return detail, raised
