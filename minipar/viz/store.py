"""The explorers' measurements kept on disk, so that a setting measured once on this
machine is answered again in milliseconds by any later kernel.

    store = result_store()             # None when MINIPAR_CACHE_DIR=off
    store.save(key, result)            # after an explorer measured a setting
    store.load(key)                    # -> the result (JSON), or None: measure it
    store.stored(keys)                 # the keys it has

Why: the explorers ship the measurements of their default lattice of settings
(minipar/viz/lattice.py); a setting outside it, or an explorer built on another model,
is a measured run, 0.05-2 s of CPU. What an explorer shows depends only on its settings
and on the code that measures them: every run is deterministic (same seed and config,
same numbers, whatever the thread timing), so the result of a setting is a pure function
of (settings, minipar's code, the libraries that compute).

That function is what the directory's name fingerprints (`fingerprint`): the bytes of
every file of the minipar package (its code, the bundled corpus and lattices), the
versions of Python, NumPy and ml_dtypes. Change any of them and the old results are
never read again (the oldest directories are deleted, `KEEP_VERSIONS`).

An entry is one JSON file per setting (the key's repr and the result: the report fields
the pictures read, never a picture), written to a temporary name and renamed, so a
reader never sees half a file and two kernels can share the directory. Loading never
unpickles: a file that does not parse or names another key is a miss (and is
overwritten by the next save). A save that fails is tried again with the directory made
again (the cache may be deleted at any time); a directory that still cannot be written
pauses saving for a minute (`ResultStore.error` says why); answering never fails
because of it. Entries are readable by their owner only (tempfile's 0600).

Where: $MINIPAR_CACHE_DIR (`off` turns it off), else $XDG_CACHE_HOME/minipar, else
~/.cache/minipar; under it `explorers/<fingerprint>/`. Deleting it is always safe.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

CACHE_ENV = "MINIPAR_CACHE_DIR"
OFF = ("off", "0", "none", "false", "")
FORMAT = 2  # of an entry file; a new format is a new fingerprint
KEEP_VERSIONS = 3  # fingerprint directories kept (several installs may share the cache)
MAX_ENTRIES = 20000  # per fingerprint (1-30 KB each); past it the oldest go
RETRY_SECONDS = 60.0  # after a save failed twice, the next try


def cache_root() -> pathlib.Path | None:
    """The cache directory the environment names, or None when the store is off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in OFF else pathlib.Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "minipar"


def package_digest(package: pathlib.Path) -> hashlib._Hash:
    """SHA-256 of every file under `package` (names and bytes; no __pycache__)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(package)).encode())
            digest.update(path.read_bytes())
    return digest


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """A digest of what every stored result depends on besides its settings (see the
    module docstring). ~10-20 ms, once per process, when this module is imported: just
    after the rest of minipar, so the files digested are the code that runs. (A kernel
    that edits minipar's files and reloads them, as %autoreload does, should set
    MINIPAR_CACHE_DIR=off.)"""
    digest = package_digest(pathlib.Path(__file__).resolve().parent.parent)  # minipar/
    digest.update(repr((FORMAT, sys.version, np.__version__,
                        ml_dtypes.__version__)).encode())
    return digest.hexdigest()[:20]


class ResultStore:
    """Entries under `directory` (a fingerprint's): `load`, `save`, `stored`."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.error: str | None = None  # why the last save failed, if it did
        self.hits = self.misses = self.saves = 0
        self._ready = False  # the directory is made (and old versions pruned)
        self._paused_until = 0.0  # monotonic time before which saves are skipped

    def _path(self, key) -> pathlib.Path:
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        return self.directory / f"{name}.json"

    def stored(self, keys) -> set:
        """Those of `keys` with an entry (not read: a file to find)."""
        return {key for key in keys if self._path(key).is_file()}

    def load(self, key) -> dict | None:
        """The result stored for `key`, or None."""
        try:
            entry = json.loads(self._path(key).read_text(encoding="utf-8"))
            if entry["key"] != repr(key) or not isinstance(entry["result"], dict):
                raise ValueError("another key, or not a result")
        except (OSError, ValueError, KeyError, TypeError):  # a miss, whatever the cause
            self.misses += 1
            return None
        self.hits += 1
        return entry["result"]

    def save(self, key, result: dict) -> None:
        """Keep a result; never raises. A write that fails is tried once more with the
        directory made again (deleting the cache is allowed at any time); if that fails
        too, saving pauses for RETRY_SECONDS (`error` says why), then is tried again."""
        if time.monotonic() < self._paused_until:
            return
        entry = {"format": FORMAT, "key": repr(key), "result": result}
        for last_try in (False, True):
            try:
                self._write(entry, self._path(key))
                break
            except OSError as error:
                self._ready = False  # make the directory again
                if last_try:
                    self.error = f"{self.directory}: {error}"
                    self._paused_until = time.monotonic() + RETRY_SECONDS
                    return
        self.error = None
        self.saves += 1
        if self.saves % 100 == 0:
            self._prune_entries()

    def _write(self, entry: dict, path: pathlib.Path) -> None:
        """Write to a temporary file beside `path`, then rename: never half a file.
        (minipar.files.atomic_write does this too, plus an fsync: a
        checkpoint must survive a crash, a cache entry lost in one is measured again,
        and an fsync would add milliseconds to the answer that saves it.)"""
        self._prepare()
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".part")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                json.dump(entry, file)
            os.replace(temporary, path)
        except BaseException:
            pathlib.Path(temporary).unlink(missing_ok=True)
            raise

    def _prepare(self) -> None:
        """Create the directory; the first time, drop the oldest fingerprints' ones."""
        if self._ready:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        os.utime(self.directory)  # "used now", for the pruning of versions
        # Only directories named like a fingerprint: MINIPAR_CACHE_DIR may name a
        # directory that holds other things.
        versions = sorted((d for d in self.directory.parent.iterdir()
                           if d.is_dir() and re.fullmatch(r"[0-9a-f]{20}", d.name)),
                          key=lambda d: d.stat().st_mtime, reverse=True)
        for old in versions[KEEP_VERSIONS:]:
            shutil.rmtree(old, ignore_errors=True)
        self._prune_entries()
        self._ready = True

    def _prune_entries(self) -> None:
        """The oldest entries past MAX_ENTRIES, and half-written files an hour old (a
        kernel stopped while writing)."""
        entries = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
        stale = [p for p in self.directory.glob("*.part")
                 if p.stat().st_mtime < time.time() - 3600]
        for path in entries[:max(0, len(entries) - MAX_ENTRIES)] + stale:
            path.unlink(missing_ok=True)


_stores: dict[pathlib.Path, ResultStore] = {}
if cache_root() is not None:
    fingerprint()


def result_store() -> ResultStore | None:
    """The process's store for the cache directory the environment names now (one per
    directory, so its error and counts persist), or None when it is off."""
    root = cache_root()
    if root is None:
        return None
    directory = root / "explorers" / fingerprint()
    if directory not in _stores:
        _stores[directory] = ResultStore(directory)
    return _stores[directory]
