"""Files minipar writes and reads: an output appears whole or not at all, an input is read
only if it is a regular file of a bounded size.

    from minipar.files import atomic_write, load_json, open_regular

    with atomic_write("runs/report.json", "w") as f:          # every output
        json.dump(report, f)
    manifest = load_json(path, what="manifest")               # every JSON input
    with open_regular(path, limit=size) as f:                 # every other input
        digest = hashlib.file_digest(f, "sha256")

Writing. `atomic_write` writes a temporary file in the target's directory (the same file
system, so the rename cannot become a copy), flushes and fsyncs it, renames it over the
target (os.replace: atomic on POSIX and on Windows) and fsyncs the directory so that the
rename survives a power cut. A reader, a crash or a full disk sees the old file or the
complete new one, never half of one; any failure, KeyboardInterrupt included, removes the
temporary file and leaves the target as it was. PyTorch's distributed checkpoint commits
its metadata the same way (torch/distributed/checkpoint/filesystem.py,
FileSystemWriter.finish: `.metadata.tmp`, fsync, rename).

Reading. A path handed to minipar may name anything: a FIFO (opening it for reading waits
for a writer, forever), /dev/zero (reading it never ends), a 200 GiB sparse file (hashing
it takes minutes). `open_regular` opens without blocking (O_NONBLOCK) and, before a byte
is read, refuses what fstat does not call a regular file and a file larger than `limit`;
`read_regular` reads at most `limit` bytes of one; `load_json` parses them and refuses
JSON nested deeper than MAX_DEPTH (a manifest nested 100,000 levels deep raised
RecursionError in the parser; a few hundred levels, in the code after it). Each refusal
is an InputFileError naming the file; readers re-raise it as their own error.

Interrupted. While a temporary (atomic_write's file, a checkpoint's staging directory) is
being written, it is listed here; `remove_temporaries()` deletes the ones still listed.
The CLI calls it when Ctrl-C ends a command: a thread that was writing one and did not
stop in time (a rank in a slow fsync) dies with the process, before its own cleanup.

Locking. `DirectoryLock` is an advisory exclusive lock on a directory (fcntl.flock on an
open descriptor of it), released by `release()` or when the process ends, however it
ends: a lock that can be taken proves that no live process holds it. Where fcntl is
missing (Windows) or the file system refuses flock, nothing is locked and `acquire` says
so by returning None: the caller then has no such proof.

This module imports only minipar.errors, so every layer may use it (a leaf helper,
tests/test_architecture.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path

from minipar.errors import InputFileError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks (DirectoryLock.acquire returns None)
    fcntl = None

# The largest JSON file minipar reads (a manifest, a trace). Those of the runs minipar
# trains are kilobytes to a few megabytes (a rank's trace: ~20 KB per step of the demo's
# model); parsing 256 MiB of JSON takes a few GiB of memory, which is where it stops.
MAX_JSON_BYTES = 256 * 2**20
# How deep minipar's own JSON nests: a manifest's entry placement is 6 levels down, a
# trace's group_ranks 5. Far below Python's recursion limit, which the code reading a
# value (repr, json.dumps, comparisons) also spends.
MAX_DEPTH = 32

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


# ------------------------------------------------------------------ writing
@contextlib.contextmanager
def atomic_write(path, mode: str = "wb"):
    """A file object (mode "wb", or "w" for UTF-8 text) whose content replaces `path`
    when the block ends without an error, and is thrown away otherwise."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode {mode!r}, expected 'w' or 'wb'")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    track_temporary(tmp)
    try:
        with open(tmp, "x" + mode[1:], encoding="utf-8" if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C, anything: the target stays as it was
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    finally:
        untrack_temporary(tmp)
    fsync_directory(path.parent)


_TEMPORARIES: set[Path] = set()  # being written now, by any thread (module docstring)
_TEMPORARIES_LOCK = threading.Lock()


def track_temporary(path) -> None:
    """List `path` (a file or a directory) as a temporary being written."""
    with _TEMPORARIES_LOCK:
        _TEMPORARIES.add(Path(path))


def untrack_temporary(path) -> None:
    """`path` is no longer a temporary: renamed into place, or removed by its writer."""
    with _TEMPORARIES_LOCK:
        _TEMPORARIES.discard(Path(path))


def remove_temporaries() -> list[Path]:
    """Delete every temporary still listed (a symlink itself, never what it points
    to); returns them. For a process that is ending (Ctrl-C): their writers are gone
    or will die with it. A rank that has not stopped yet may still add a file to a
    staging directory while it is removed (rmtree then leaves the directory): what is
    still there, or listed meanwhile, is removed again, for at most ~1 s."""
    removed: list[Path] = []
    pending: list[Path] = []
    for _ in range(50):
        with _TEMPORARIES_LOCK:
            left = sorted(_TEMPORARIES | set(pending))
            _TEMPORARIES.clear()
        for path in left:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        removed += [p for p in left if p not in removed]
        pending = [p for p in left if p.exists() or p.is_symlink()]
        if not pending and not _TEMPORARIES:
            break
        time.sleep(0.02)
    return removed


def fsync_directory(directory) -> None:
    """Make the renames in `directory` durable (POSIX: fsync the directory itself).
    Best effort: Windows cannot open a directory, and its renames need no such step."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------ reading
def _size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _check_regular(path, status: os.stat_result, limit: int, what: str) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = next((name for test, name in _KINDS if test(status.st_mode)), "not a file")
        raise InputFileError(path, f"{kind}, not a regular file")
    if status.st_size > limit:
        raise InputFileError(path, f"{_size(status.st_size)}, larger than a {what} can be "
                             f"({_size(limit)} at most)")


@contextlib.contextmanager
def open_regular(path, limit: int, what: str = "file"):
    """`path` opened for reading in binary, if it is a regular file of at most `limit`
    bytes (else InputFileError). A missing or unreadable file raises the OSError."""
    _check_regular(path, os.stat(path), limit, what)  # a FIFO is not even opened
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        _check_regular(path, os.fstat(fd), limit, what)  # the file opened is the one checked
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_regular(path, limit: int, what: str = "file") -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (open_regular)."""
    with open_regular(path, limit, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since it was checked
        raise InputFileError(path, f"larger than a {what} can be ({_size(limit)} at most)")
    return data


def loads_json(data: bytes | str, path, what: str = "file"):
    """JSON text parsed, nested at most MAX_DEPTH deep; else InputFileError."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise InputFileError(path, "JSON nested deeper than Python can parse") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputFileError(path, f"not JSON ({err})") from None
    if depth(value) > MAX_DEPTH:
        raise InputFileError(path, f"JSON nested more than {MAX_DEPTH} levels deep (a "
                             f"{what} nests a few)")
    return value


def load_json(path, limit: int = MAX_JSON_BYTES, what: str = "file"):
    """The JSON of `path`, a regular file of at most `limit` bytes, nested at most
    MAX_DEPTH deep (else InputFileError)."""
    return loads_json(read_regular(path, limit, what), path, what)


def depth(value) -> int:
    """How deep lists and objects nest in `value` (a scalar is 0), without recursion;
    stops counting past MAX_DEPTH."""
    if not isinstance(value, dict | list):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_DEPTH:
        node, level = stack.pop()
        deepest = max(deepest, level)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, level + 1) for child in children
                     if isinstance(child, dict | list))
    return deepest


# ------------------------------------------------------------------ locking
class DirectoryLock:
    """An advisory exclusive lock on a directory (module docstring)."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self._fd: int | None = None

    def acquire(self, timeout: float = 0.0) -> bool | None:
        """Take the lock, waiting up to `timeout` seconds for another holder to let go:
        True if taken, False if another process still holds it, None if locks are not
        available here (nothing was locked)."""
        if fcntl is None:
            return None
        deadline = time.monotonic() + timeout
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        os.close(fd)
                        return False
                    time.sleep(0.01)
                except OSError:  # a file system without flock (some network ones)
                    os.close(fd)
                    return None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        """Let go (closing the descriptor releases the lock)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
