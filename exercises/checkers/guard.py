"""The grader's own files, compared and put back after every file it grades.

The layer that holds where the OS sandbox does not (sandbox.py): before a worker starts,
snapshot() reads every file of the guarded trees (exercises/, solutions included, and
minipar/); after it ends, restore() writes back whatever changed or went missing,
removes .py files added (a package harness/ would be imported in place of harness.py)
and compiled files written meanwhile (Python would load them in place of their source),
and returns what it put back: the grader fails the file when anything was.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import minipar

GUARDED = (Path(__file__).resolve().parents[1], Path(minipar.__file__).resolve().parent)


def _files(tree: Path):
    for folder, subfolders, names in os.walk(tree):
        subfolders[:] = [s for s in subfolders if s != "__pycache__"]
        for name in names:
            yield Path(folder) / name


def snapshot(trees=GUARDED) -> dict:
    """The trees' files ({path: contents}) and their compiled files' times."""
    files = {path: path.read_bytes() for tree in trees for path in _files(tree)}
    compiled = {path: path.stat().st_mtime_ns for tree in trees
                for path in tree.rglob("__pycache__/*")}
    return {"trees": trees, "files": files, "compiled": compiled}


def restore(before: dict) -> list[str]:
    """Put the trees back as `before` holds them (module docstring); return the files put
    back or removed, relative to their tree's parent folder."""
    changed = []
    for path, contents in before["files"].items():
        try:
            same = path.read_bytes() == contents
        except OSError:
            same = False
        if not same:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(contents)
            changed.append(path)
    for tree in before["trees"]:
        for path in _files(tree):
            if path.suffix == ".py" and path not in before["files"]:  # it could shadow one
                path.unlink()
                changed.append(path)
        for path in tree.rglob("__pycache__/*"):
            with contextlib.suppress(OSError):
                if before["compiled"].get(path) != path.stat().st_mtime_ns:
                    path.unlink()
    return [next(str(p.relative_to(t.parent)) for t in before["trees"] if p.is_relative_to(t))
            for p in changed]

