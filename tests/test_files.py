"""minipar.files: an output appears whole or not at all; an input is read only if it is
a regular file of a bounded size, its JSON nested no deeper than minipar's own."""

from __future__ import annotations

import json
import os
import threading

import pytest

from minipar.errors import InputFileError, MiniparError
from minipar.files import (
    MAX_DEPTH,
    DirectoryLock,
    atomic_write,
    depth,
    load_json,
    loads_json,
    open_regular,
    read_regular,
)


# ------------------------------------------------------------------ writing
def test_atomic_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with atomic_write(path, "w") as f:
        f.write("new")
        assert path.read_text() == "old"  # nothing visible before the block ends
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   KeyboardInterrupt()])
def test_a_failed_or_interrupted_write_keeps_the_old_file_and_no_temporary(tmp_path, error):
    path = tmp_path / "out.npz"
    path.write_bytes(b"the earlier report")
    with pytest.raises(type(error)):
        with atomic_write(path) as f:
            f.write(b"half a fi")
            raise error
    assert path.read_bytes() == b"the earlier report"
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]


def test_atomic_write_on_a_full_disk(small_disk):
    """A real full disk (a 64 KiB tmpfs): the write fails, the old file stays whole."""
    disk = small_disk("64k")
    path = disk / "report.json"
    path.write_text("earlier")
    with pytest.raises(OSError) as caught:
        with atomic_write(path) as f:
            f.write(b"x" * (1 << 20))
    assert caught.value.errno == 28
    assert path.read_text() == "earlier" and [p.name for p in disk.iterdir()] == ["report.json"]


# ------------------------------------------------------------------ reading
def test_a_regular_file_within_its_limit_is_read(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"a": [1, 2]}')
    assert load_json(path) == {"a": [1, 2]}
    assert read_regular(path, limit=13) == b'{"a": [1, 2]}'
    with open_regular(path, limit=100) as f:
        assert f.read(1) == b"{"


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "rank0.json"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match=r"rank0\.json: a FIFO .*not a regular file"):
        load_json(fifo)


def test_a_symlink_to_dev_zero_is_refused(tmp_path):
    link = tmp_path / "manifest.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(InputFileError, match="a character device, not a regular file"):
        read_regular(link, limit=1 << 20)


def test_a_directory_and_a_file_too_large_are_refused(tmp_path):
    with pytest.raises(InputFileError, match="a directory, not a regular file"):
        load_json(tmp_path)
    sparse = tmp_path / "big.json"
    with open(sparse, "wb") as f:
        f.truncate(200 * 2**30)  # 200 GiB, sparse: nothing is written, nothing is read
    with pytest.raises(InputFileError, match=r"200\.0 GiB, larger than a trace can be "
                                             r"\(256\.0 MiB at most\)"):
        load_json(sparse, what="trace")


def test_a_missing_file_is_the_os_error():
    with pytest.raises(FileNotFoundError):
        load_json("/nonexistent/minipar.json")


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than Python can parse"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} levels"),
    ("{", "not JSON"),
    (b"\xff\xfe", "not JSON"),
])
def test_json_that_is_not_or_is_nested_too_deep_is_refused(text, match):
    with pytest.raises(InputFileError, match=match) as caught:
        loads_json(text, "m.json", what="manifest")
    assert isinstance(caught.value, MiniparError) and caught.value.path == "m.json"


def test_depth_counts_containers_without_recursion():
    assert depth(1) == 0 and depth([]) == 1 and depth({"a": [{"b": []}]}) == 4
    deep: list = []
    for _ in range(100_000):  # built and measured without Python recursion
        deep = [deep]
    assert depth(deep) > MAX_DEPTH
    assert json.loads(json.dumps([[1]])) == [[1]]


# ------------------------------------------------------------------ locking
def test_a_directory_lock_excludes_a_second_holder_until_released(tmp_path):
    first, second = DirectoryLock(tmp_path), DirectoryLock(tmp_path)
    taken = first.acquire()
    if taken is None:
        pytest.skip("no advisory locks on this system (fcntl.flock)")
    assert taken is True and second.acquire() is False
    waiter = threading.Thread(target=lambda: setattr(second, "got", second.acquire(30)))
    waiter.start()
    first.release()
    waiter.join()
    assert second.got is True
    second.release()
