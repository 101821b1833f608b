"""Where checkpoints live: written beside the old one, renamed into place, found again.

    runs/                              a --save DIR
        step-000002/                   a checkpoint (checkpoint.py: rank files + manifest)
        .step-000004.3f9c0e1a2b4d.partial/   run 3f9c0e1a2b4d writing step 4 (locked)
        .step-000002.3f9c0e1a2b4d.old/       step 2 being replaced by run 3f9c0e1a2b4d

A save writes every file of its checkpoint into its own staging directory,
`.step-NNNNNN.<run>.partial` beside the destination, and only when the manifest is
written there renames the whole directory into place (`commit`). A checkpoint already at
that step is renamed aside first and deleted once the new one is in place. So a save that
dies (kill -9, a full disk, Ctrl-C) at any moment leaves the checkpoint that was there
before, complete; the runs sharing a save directory never write into the same directory
(each its own staging, named by its run id); and the ones that commit the same step take
turns. Orbax commits a checkpoint the same way (AtomicRenameTemporaryPath in
orbax/checkpoint/_src/path/atomicity.py: `<step>.orbax-checkpoint-tmp`, renamed on
finalize); it refuses to save a step twice, where minipar replaces it.

Locks (minipar.files.DirectoryLock, fcntl.flock on POSIX): a staging directory is locked
while its run writes it, and the save directory while a save begins or commits, so the
swaps of two runs do not interleave. What an interrupted save left is cleaned by the next
save into the directory (`recover`): a staging directory whose lock is free (its writer
is gone, however it died), and the old checkpoint of a swap interrupted between its two
renames (put back if the new one is not in place). Where locks are not available
(Windows, some network file systems), only the staging directories of one's own run are
known to be abandoned, and two runs committing the same step at the same instant may
make one of them fail (the other's checkpoint stays).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

from minipar.errors import CheckpointError, InputFileError
from minipar.files import (
    DirectoryLock,
    fsync_directory,
    load_json,
    track_temporary,
    untrack_temporary,
)
from minipar.train.manifest import MANIFEST

STEP = re.compile(r"step-(\d+)")
LEFTOVER = re.compile(r"\.(step-\d+)\.([0-9a-f]+)\.(partial|old)")
# What a checkpoint directory holds (temporaries of the atomic writer included): a
# directory in the way of a commit is replaced only if it is one.
OURS = re.compile(r"rank-\d+\.npz|manifest\.json|\.(rank-\d+\.npz|manifest\.json)\..+")
LOCK_TIMEOUT_S = 60.0  # a save begins or commits in milliseconds: longer means stuck


def new_run_id() -> str:
    """A run's id: 12 random hex digits (PyTorch's distributed checkpoint tags each save
    with a uuid4, its StorageMeta.save_id)."""
    return secrets.token_hex(6)


def staging_path(directory: Path, run: str) -> Path:
    return directory.parent / f".{directory.name}.{run}.partial"


class _Locked:
    """The save directory's lock, held for a block (a save's begin or commit)."""

    def __init__(self, parent: Path):
        self.lock = DirectoryLock(parent)

    def __enter__(self):
        if self.lock.acquire(timeout=LOCK_TIMEOUT_S) is False:
            raise TimeoutError(f"{self.lock.directory}: another run has held its lock for "
                               f"{LOCK_TIMEOUT_S:g} s")
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


# ------------------------------------------------------------------ saving (rank 0)
def begin(directory: Path, run: str, lock: DirectoryLock) -> Path:
    """Create and lock this run's staging directory for `directory` (cleaning what
    interrupted saves left beside it first); returns it."""
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(directory, run)
    with _Locked(parent):
        recover(parent, run)
        staging.mkdir()
        track_temporary(staging)  # (removed if the process ends before discard does)
        lock.acquire()
    return staging


def commit(staging: Path, directory: Path, run: str) -> None:
    """Rename the complete checkpoint in `staging` into place at `directory`; a
    checkpoint already there is retired only now, its replacement complete."""
    parent = directory.parent
    retired = parent / f".{directory.name}.{run}.old"
    with _Locked(parent):
        if directory.exists() or directory.is_symlink():
            if not directory.is_dir() or not all(OURS.fullmatch(p.name)
                                                 for p in directory.iterdir()):
                raise FileExistsError(f"{directory} is in the way and is not a minipar "
                                      "checkpoint: move it elsewhere")
            os.rename(directory, retired)
        os.rename(staging, directory)
        fsync_directory(parent)
        remove(retired)


def discard(staging: Path, lock: DirectoryLock) -> None:
    """After a save, committed or not: remove the staging directory if it is still
    there (the save failed or was interrupted), then let go of its lock."""
    try:
        remove(staging)
        if not (staging.exists() or staging.is_symlink()):  # (another rank may still be
            untrack_temporary(staging)  # writing into it: then the CLI's cleanup retries)
    finally:
        lock.release()


def remove(path: Path) -> None:
    """Remove a directory of ours, or a symlink (never what it points to); quietly if
    it is already gone."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def recover(parent: Path, run: str) -> None:
    """With the save directory locked: remove the staging directories of saves that
    died, and finish the swap of one interrupted between its two renames by putting the
    old checkpoint back (module docstring)."""
    for path in sorted(parent.iterdir()):
        match = LEFTOVER.fullmatch(path.name)
        if match is None:
            continue
        name, owner, kind = match.groups()
        if kind == "old":
            if (parent / name).exists():  # the swap finished: the new one is in place
                remove(path)
            else:
                os.rename(path, parent / name)
            continue
        lock = DirectoryLock(path)
        try:
            held = lock.acquire()
        except OSError:  # gone meanwhile
            continue
        try:
            if held or (held is None and owner == run):  # its writer is gone
                remove(path)
        finally:
            lock.release()


# ------------------------------------------------------------------ finding one
def committed(directory: Path) -> dict[int, Path]:
    """{step: checkpoint} of a save directory: each step-NNNNNN with a manifest, or the
    old checkpoint of a swap interrupted between its renames (until `recover` puts it
    back)."""
    found: dict[int, Path] = {}
    for path in directory.iterdir():
        match = STEP.fullmatch(path.name)
        leftover = LEFTOVER.fullmatch(path.name)
        if leftover is not None and leftover.group(3) == "old":
            match = None if (directory / leftover.group(1)).exists() else \
                STEP.fullmatch(leftover.group(1))
        if match is not None and (path / MANIFEST).exists():
            found[int(match.group(1))] = path
    return found


def resolve(directory) -> Path:
    """A checkpoint directory, or a save directory (step-NNNNNN): its latest checkpoint,
    if every checkpoint in it is of one run's trajectory (a run and the runs that resumed
    it: one origin). A directory holding several runs' checkpoints is refused: which one
    is meant is the user's to say."""
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        return directory
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    found = committed(directory) if directory.is_dir() else {}
    if not found:
        raise CheckpointError(f"{directory / MANIFEST}: missing; {directory} is not a "
                              "minipar checkpoint (nor a --save directory holding one), or "
                              "its save did not finish")
    runs: dict[str, list[int]] = {}
    for step in sorted(found):
        runs.setdefault(origin_of(found[step]), []).append(step)
    latest = found[max(found)]
    if len(runs) > 1:
        listed = "; ".join(f"run {run}: {', '.join(found[s].name for s in steps)}"
                           for run, steps in runs.items())
        raise CheckpointError(f"{directory} holds the checkpoints of {len(runs)} runs "
                              f"({listed}): name the one you mean, e.g. {latest}")
    return latest


def origin_of(checkpoint: Path) -> str:
    """The run whose trajectory a checkpoint is, as its manifest says (read, not yet
    checked: loading checks)."""
    manifest = load_manifest(checkpoint / MANIFEST)
    origin = manifest.get("origin") if isinstance(manifest, dict) else None
    return origin if isinstance(origin, str) else "(none)"


def load_manifest(path: Path):
    """The JSON of a manifest file, read within bounds (minipar.files), not yet checked
    (manifest.check_manifest does that)."""
    try:
        return load_json(path, what="manifest")
    except InputFileError as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err.detail})") from None
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err.strerror or err})") from None
