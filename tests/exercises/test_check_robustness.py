"""Hand-ins that fight the checker: one that exits, loops at import, raises
KeyboardInterrupt, is no Python file; and command-line mistakes. Each gives a report or
one line, and a non-zero exit status: 0 means "every check passes", nothing else."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import exercises.check as check
from exercises.check import main

ROOT = Path(__file__).resolve().parents[2]
SOLUTION_01 = (ROOT / "exercises" / "solutions" / "ex01_ring_allreduce.py").read_text()


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "exercises.check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MINIPAR_CACHE_DIR": "off"})


def hand_in(tmp_path, body: str, name: str = "ex01_ring_allreduce.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def with_ring(body: str) -> str:
    """The solution of 01 with its ring_all_reduce replaced by `body` (one statement)."""
    return (SOLUTION_01 + "\n\ndef ring_all_reduce(x, group=None):\n    import sys\n"
            f"    {body}\n")


# ------------------------------------------------------------------ 1. sys.exit
def test_sys_exit_at_import_is_an_error_not_a_pass(tmp_path, capsys):
    path = hand_in(tmp_path, "import sys\n\nsys.exit(0)\n")
    assert main(["01", "--file", str(path)]) == 1
    out = capsys.readouterr().out
    assert "ERROR the file imports" in out
    assert "the file under test called sys.exit(0) (at line 3)" in out


@pytest.mark.parametrize("statement, call", [("raise SystemExit(0)", "sys.exit(0)"),
                                             ("sys.exit(3)", "sys.exit(3)"),
                                             ("sys.exit('done')", "sys.exit('done')"),
                                             ("sys.exit()", "sys.exit()")])
def test_system_exit_in_the_tested_function_is_an_error(tmp_path, capsys, statement, call):
    path = hand_in(tmp_path, with_ring(statement))
    assert main(["01", "--file", str(path)]) == 1
    out = capsys.readouterr().out
    assert "ERROR your code raised SystemExit (while checking: runs without deadlock" in out
    assert (f"the file under test called {call} (at line {line_of(path, statement)})"
            in out), out
    assert "(raised on rank 0)" in out


def test_the_command_exits_non_zero_with_a_report_when_the_file_exits(tmp_path):
    path = hand_in(tmp_path, with_ring("raise SystemExit(0)"))
    result = run("01", "--file", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the file under test called sys.exit(0)" in result.stdout
    assert "checks pass, " in result.stdout


# ------------------------------------------------------------------ 2. a loop at import
def test_a_loop_at_import_is_reported_after_the_import_timeout(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(check, "IMPORT_TIMEOUT", 0.5)
    # Before the fix this "loop" ended by itself after 4 s (so the test failed, not hung).
    path = hand_in(tmp_path, "import time\n\nend = time.monotonic() + 4\n"
                             "while time.monotonic() < end:\n    pass\n")
    start = time.monotonic()
    assert main(["01", "--file", str(path)]) == 1
    assert time.monotonic() - start < 3.5
    out = capsys.readouterr().out
    assert (f"importing {path} did not finish in 0.5 s: is there a loop or a long "
            "computation at module level?") in out
    assert "FAIL  the file imports" in out


def test_the_student_file_is_imported_under_the_timeout_too(monkeypatch):
    seen = []
    real = check._import_with_timeout

    def spy(load, where):
        seen.append(where)
        return real(load, where)

    monkeypatch.setattr(check, "_import_with_timeout", spy)
    assert main(["05", "--solution"]) == 0
    assert seen == ["exercises/solutions/ex05_one_f_one_b.py"]


# ------------------------------------------------------------------ 3. KeyboardInterrupt
# (in a subprocess: before the fix the interrupt would have stopped this pytest session)
def test_keyboard_interrupt_in_the_tested_function_is_an_error(tmp_path):
    path = hand_in(tmp_path, with_ring("raise KeyboardInterrupt"))
    result = run("01", "--file", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("ERROR your code raised KeyboardInterrupt (while checking: runs without "
            "deadlock") in result.stdout
    assert f"at ex01_ring_allreduce.py:{line_of(path, 'raise KeyboardInterrupt')}" \
        in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_keyboard_interrupt_at_import_is_a_failure_of_the_file(tmp_path):
    path = hand_in(tmp_path, "x = 1\nraise KeyboardInterrupt\n")
    result = run("01", "--file", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL  the file imports" in result.stdout
    assert "KeyboardInterrupt at line 2" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def _wait_for_line(stream, text: str, timeout: float) -> bool:
    """Whether a line containing `text` came out of `stream` within `timeout` seconds."""
    seen, deadline = b"", time.monotonic() + timeout
    while text.encode() not in seen and time.monotonic() < deadline:
        if select.select([stream], [], [], 0.05)[0]:
            data = os.read(stream.fileno(), 1 << 16)
            if not data:
                break
            seen += data
    return text.encode() in seen


def test_ctrl_c_of_the_user_still_stops_the_checker(tmp_path):
    # The file under test may write no file (its process is confined): it says that it
    # started on its output, which the checker shows as it comes.
    path = hand_in(tmp_path, with_ring("import time; print('started', flush=True); "
                                       "time.sleep(60)"))
    # (`python -m exercises.check` taking SIGINT as a terminal's command does: a shell's
    # background job ignores it, and a child inherits that)
    as_a_terminal = ("import runpy, signal, sys; "
                     "signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv[0] = 'exercises.check'; "
                     "runpy.run_module('exercises.check', run_name='__main__', alter_sys=True)")
    process = subprocess.Popen([sys.executable, "-c", as_a_terminal, "01", "--file",
                                str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "MINIPAR_CACHE_DIR": "off"})
    try:
        started = _wait_for_line(process.stdout, "started", 60)
        assert started
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, out + err
    assert "checks pass" not in out
    assert err.strip().splitlines() == ["python -m exercises.check: interrupted"]


# ------------------------------------------------------------------ 4. not a Python file
def _png(tmp_path):
    picture = tmp_path / "pic.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n")
    return picture


@pytest.mark.parametrize("make, says", [
    (_png, "{path} is not a Python file (.py)"),
    (lambda tmp_path: tmp_path, "{path} is a directory: give the .py file"),
    (lambda tmp_path: tmp_path / "nope.py", "--file {path}: no such file"),
], ids=["not python", "a directory", "missing"])
def test_a_file_that_cannot_be_checked_is_one_line(tmp_path, capsys, make, says):
    path = make(tmp_path)
    assert main(["01", "--file", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "python -m exercises.check: error: " + says.format(path=path)]


# ------------------------------------------------------------------ 5. argument errors
@pytest.mark.parametrize("key", ["99", "abc", "-1"])
def test_an_unknown_exercise_is_one_line_with_the_choices(capsys, key):
    with pytest.raises(SystemExit) as exit_info:
        main([key])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"python -m exercises.check: error: no exercise {key!r}; choose one of "
        "01 (ring_allreduce), 02 (tensor_parallel), 03 (data_parallel), 04 (zero2), "
        "05 (one_f_one_b), 06 (predict_bytes), 07 (zero_bubble), 08 (zero3_prefetch), "
        "09 (zero2_backward), 10 (sequence_parallel), 11 (predict_activations), "
        "12 (port_recipe), 13 (choose_layout), or 'all'"]


def test_the_command_prints_one_line_for_an_argument_error():
    result = run("99")
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "no exercise '99'" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["--list", "99"], "--list takes no EXERCISE (got 99)"),
    (["--list", "01", "02"], "--list takes no EXERCISE (got 01 02)"),
    (["--file", "x.py"], "--file checks one exercise: name exactly one"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_other_argument_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"python -m exercises.check: error: {message}"]
