"""One rank in a process of its own (started by rank_processes.py, one per rank).

    python -m exercises.checkers.rank_process SPEC      # SPEC: JSON from the grader

Isolates and confines itself first (sandbox.py: no network, no IPC, nothing writable);
installs rank_dist.py as minipar.distributed ("stand_in", for ranks kept apart) or
imports the dataclasses the calls may carry ("classes", for plain functions, with the
real minipar); imports the file under test; then answers the grader's calls:
{"op": "call", "function", "rank", "world", "args"[, "group", "kind"]}, each answered
{"op": "return", "value", "args"} (the result and the arguments' final contents, packed
as wire.py packs them) or {"op": "raise", "text"} with the error in one line.
"""

from __future__ import annotations

import json
import sys
import traceback
import types
from pathlib import Path

from exercises.checkers import sandbox


def _install(rank_dist) -> None:
    """rank_dist as minipar.distributed and the submodules a student may import from."""
    package = types.ModuleType("minipar", "minipar as a rank's own process sees it")
    package.__path__ = []  # a package with nothing else in it
    package.distributed = rank_dist
    sys.modules["minipar"] = package
    for name in ("", ".p2p", ".context", ".groups"):
        sys.modules["minipar.distributed" + name] = rank_dist


def _where(error: BaseException, path: str) -> str:
    """" (at <file>:<line>)" of the deepest frame in the file under test, or ""."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if Path(f.filename).resolve() == Path(path).resolve()]
    return f" (at {Path(path).name}:{frames[-1].lineno})" if frames else ""


def _serve(module, path: str, rank_dist, classes: dict) -> None:
    from exercises.checkers.wire import pack, unpack

    while True:
        header, arrays = rank_dist.receive()
        rank_dist.enter(int(header["rank"]), int(header["world"]))
        try:
            args = unpack(header["args"], arrays, classes)
            kwargs = {}
            if "group" in header:  # a rank's function: f(..., group=None or a group)
                kwargs["group"] = (None if header["group"] is None else
                                   rank_dist.ProcessGroup(tuple(header["group"]),
                                                          header["kind"]))
            value = getattr(module, header["function"])(*args, **kwargs)
            out = []
            answer = {"op": "return", "value": pack(value, out, classes),
                      "args": pack(args, out, classes)}
        except BaseException as error:  # noqa: BLE001 - the grader reports what it was
            text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            rank_dist.reply({"op": "raise", "text": text + _where(error, path)})
            continue
        rank_dist.reply(answer, out)


def _classes(names) -> dict:
    """{name: class} of "module:qualname" strings (the grader's, before the file runs)."""
    import importlib

    found = {}
    for entry in names:
        module, name = entry.split(":")
        found[name] = getattr(importlib.import_module(module), name)
    return found


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    held = sandbox.isolate_network() + sandbox.confine((), parent=spec["parent"])
    from exercises.checkers import rank_dist  # NumPy's threads start after confine
    from exercises.checkers.import_failures import import_failure
    from exercises.checkers.worker import import_file

    rank_dist.connect(spec["to_grader"], spec["from_grader"])
    if spec["stand_in"]:
        _install(rank_dist)
    classes = _classes(spec["classes"])
    module, error = import_file(spec["file"], spec["name"])
    if error is not None:
        detail, _ = import_failure(error, spec["file"])
        rank_dist.reply({"event": "import-failed", "text": detail})
        return 1
    rank_dist.reply({"event": "imported", "sandbox": held})
    _serve(module, spec["file"], rank_dist, classes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
