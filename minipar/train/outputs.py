"""Where results go, checked before the work starts.

A run that trains for a minute and then cannot write its report (a missing directory, a
typo that names a directory, an empty path) has lost that minute. So every output path
is checked first, by trying what the write will do: the nearest existing directory must
take a new file (a probe file is created and removed; permission bits alone would say
yes to root on a read-only or virtual file system). If a write still fails at the end
(the disk filled up meanwhile), `OutputError.report` keeps what was computed.

    check_output_file("json", "runs/report.json")   # --json, --out PNG, consolidate OUT
    check_output_dir("save", "runs")                 # --save DIR, demo --out DIR
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from minipar.errors import InputFileError, OutputError
from minipar.files import load_json
from minipar.train.manifest import MANIFEST


def _writable_dir(directory: Path, setting: str, what: str) -> None:
    """Raise OutputError unless a file can be created in `directory` (which exists)."""
    if not directory.is_dir():
        raise OutputError(setting, f"{what}: {directory} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".minipar-probe-"):
            pass
    except OSError as err:
        raise OutputError(setting, f"{what}: cannot write into {directory} "
                          f"({err.strerror or err}); choose another path") from None


def check_output_file(setting: str, path) -> Path:
    """The file `path` can be written: not empty, not a directory, in an existing,
    writable directory (created by nobody: a typo in it should not be)."""
    if path is None or str(path).strip() == "":
        raise OutputError(setting, "empty path: give a file name, e.g. runs/out.json")
    named, path = str(path), Path(path)
    if path.is_dir():
        raise OutputError(setting, f"{path} is a directory; give a file name inside it, "
                          f"e.g. {path / 'out.json'}")
    if named.endswith(("/", "\\")):  # Path() drops the slash: "o.npz/" wrote o.npz
        raise OutputError(setting, f"{named} ends with a slash, as a directory does; give "
                          "a file name")
    parent = path.parent
    if not parent.exists():
        raise OutputError(setting, f"{path}: directory {parent} does not exist; create it "
                          "first (mkdir -p) or choose another path")
    if _is_checkpoint(parent):  # `consolidate CKPT CKPT/manifest.json` wrote over it
        raise OutputError(setting, f"{path}: {parent} is a minipar checkpoint (it has a "
                          f"{MANIFEST}); writing there would change or break what it holds: "
                          "choose another directory")
    _writable_dir(parent, setting, str(path))
    return path


def _is_checkpoint(directory: Path) -> bool:
    """Does `directory` hold a minipar checkpoint's manifest (its format, not only its
    name: a web app's manifest.json is no checkpoint)? Read as JSON, never unpickled, and
    only if it is a regular file (a FIFO named manifest.json would block the read)."""
    try:
        manifest = load_json(directory / MANIFEST, what="manifest")
    except (OSError, InputFileError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith(
        "minipar.checkpoint/")


def check_output_dir(setting: str, path) -> Path:
    """The directory `path` can be created (parents included) or written into: not empty
    (which would scatter files into the current directory), not a file."""
    if path is None or str(path).strip() == "":
        raise OutputError(setting, "empty path (it would write into the current directory): "
                          "give a directory, e.g. runs")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(setting, f"{path} is a file, not a directory; choose a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    _writable_dir(existing, setting, str(path))
    return path
