"""Hand-ins written to fool the grader rather than solve the exercise (hostile/): each one
fails, exits 1, leaves the grader as it was and lets the command end. The grader's
layers are tested apart where one alone must hold: the text check, the checks with
every rank in a process of its own, the OS sandbox (sandbox.py), and the files put back
where there is no sandbox (MINIPAR_GRADER_SANDBOX=off)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from exercises.checkers import ex01_ring_allreduce, sandbox
from exercises.checkers.grader import OUTPUT_MARK

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = Path(__file__).resolve().parent / "hostile"
SOLUTION_01 = (ROOT / "exercises" / "solutions" / "ex01_ring_allreduce.py").read_text()
# Through a process whose working folder is `cwd`: a hand-in that reaches for the folder
# its grader was started from (/proc/<parent>/cwd) finds that one, not this checkout.
FROM = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def grade(*args, cwd=ROOT, sandboxed=True, timeout=60) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINIPAR_CACHE_DIR": "off",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if not sandboxed:
        env[sandbox.DISABLE_ENV] = "off"
    return subprocess.run([sys.executable, "-c", FROM, sys.executable, "-m",
                           "exercises.check", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def last_line(result) -> str:
    return result.stdout.rstrip().splitlines()[-1]


@pytest.mark.parametrize("exercise, name, says", [
    ("01", "importlib_ring", "importlib (line 4): imports by a computed name"),
    ("01", "shared_dict", "not with each rank in a process of its own"),
    ("01", "patch_allclose", "np.allclose (line 8): changes the module np it imports"),
    ("01", "patch_harness", "harness.Report.passed (line 7): changes the module harness"),
    ("01", "atexit_exit", "values differ from np.sum over ranks [0, 1]"),
    ("01", "fake_pass", "exit status 0 and no report: did the file under test call os._exit"),
    ("05", "patch_checker_05", "not when the grader runs them"),
    ("03", "forge_report", "it is not signed with the checker's key"),
    ("05", "forge_report", "it is not signed with the checker's key"),
])
def test_a_hand_in_that_fools_the_checker_fails(exercise, name, says):
    result = grade(exercise, "--file", str(HOSTILE / f"{name}.py"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert says in result.stdout, result.stdout
    assert " checks pass, " in last_line(result), result.stdout  # the grader's verdict
    for line in result.stdout.splitlines():  # what the file printed is marked as its own
        assert "checks pass." not in line or line.startswith(OUTPUT_MARK), line


@pytest.fixture(scope="module")
def rank_spawn():
    """What the grader gives rank processes: its sandbox's environment and folder."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "MINIPAR_CACHE_DIR": "off",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        yield {"env": env, "cwd": folder}


@pytest.mark.parametrize("name, fails, says", [
    ("importlib_ring", "runs without deadlock", "No module named 'minipar.distributed.ring'"),
    ("shared_dict", "runs without deadlock", "KeyError"),
    ("patch_allclose", "values equal x_0 + x_1 + ... + x_{n-1} (np.sum in rank order)",
     "values differ from np.sum over ranks [0, 1] at rank 0"),
])
def test_with_every_rank_in_its_own_process_the_data_gives_them_away(rank_spawn, name, fails,
                                                                      says):
    """The checks with every rank in a process of its own, alone (as if a file got past
    the text check): the library's ring has no cluster there, a rank's memory holds only
    its own input, and the values are compared by the grader's own NumPy."""
    report = ex01_ring_allreduce.check_in_rank_processes(str(HOSTILE / f"{name}.py"),
                                                         spawn=rank_spawn)
    failed = {o.name: o.detail for o in report.outcomes if o.status == "fail"}
    assert not report.passed
    assert any(n.startswith(fails) and says in d for n, d in failed.items()), failed


def test_the_solution_passes_with_every_rank_in_its_own_process(rank_spawn):
    path = ROOT / "exercises" / "solutions" / "ex01_ring_allreduce.py"
    report = ex01_ring_allreduce.check_in_rank_processes(str(path), spawn=rank_spawn)
    assert all(o.status == "pass" for o in report.outcomes), report.render()


# ------------------------------------------------------------------ the grader's files
def digest(folder: Path) -> str:
    total = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            total.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return total.hexdigest()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of the exercises (minipar comes from this checkout), graded from there: a
    grader that let a hand-in write would damage only the copy."""
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandbox", "no sandbox"])
def test_a_hand_in_cannot_change_the_grader_or_delete_the_solutions(checkout, sandboxed):
    if sandboxed and not landlock():
        pytest.skip("no Landlock on this kernel: the grader's files are only put back")
    before = digest(checkout / "exercises")
    for name in ("rewrite_harness", "delete_solutions"):
        result = grade("01", "--file", str(HOSTILE / f"{name}.py"), cwd=checkout,
                       sandboxed=sandboxed)
        assert result.returncode == 1, result.stdout + result.stderr
        assert (checkout / "exercises" / "solutions" / "ex01_ring_allreduce.py").is_file()
        assert digest(checkout / "exercises") == before, result.stdout
        if not sandboxed:  # the write happened: put back, and a failure of the file
            assert "FAIL  leaves the grader's files alone" in result.stdout
            assert "put back as they were" in result.stdout
    stub = grade("01", cwd=checkout)  # the next student's stub is still a stub
    assert stub.returncode == 1 and "still to write: ring_all_reduce()" in last_line(stub)


def test_a_thread_left_running_at_import_does_not_keep_the_checker(tmp_path):
    """The reference ring, whose import starts a thread that is not a daemon (daemon=False:
    one started by a daemon thread would be one), which Python waits for at exit."""
    hand_in = tmp_path / "thread_at_import.py"
    hand_in.write_text(SOLUTION_01 + "\nimport threading\nimport time\n\nthreading.Thread("
                       "target=time.sleep, args=(60,), daemon=False).start()\n")
    start = time.monotonic()
    result = grade("01", "--file", str(hand_in), timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert last_line(result) == "All 8 checks pass."
    assert time.monotonic() - start < 25


# ------------------------------------------------------------------ the OS sandbox itself
def landlock() -> bool:
    return sandbox_probe("print(bool(sandbox.confine([])))") == "True"


def sandbox_probe(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", f"from exercises.checkers import sandbox\n{code}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    return result.stdout.strip() or result.stderr.strip()


PROBE = """
import os, socket
held = sandbox.isolate_network() + sandbox.confine([])
tried = {}
def attempt(name, action):
    try:
        action()
        tried[name] = "allowed"
    except OSError:
        tried[name] = "refused"
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
attempt("write", lambda: open(%r, "w").close())
attempt("signal parent", lambda: os.kill(os.getppid(), 0))
attempt("udp", lambda: udp.sendto(b"x", ("127.0.0.1", 9)))
attempt("parent memory", lambda: open(f"/proc/{os.getppid()}/mem", "rb").close())
print(held, sorted(tried.items()))
"""


def test_a_confined_process_cannot_write_signal_the_grader_or_reach_the_network(tmp_path):
    if not landlock():
        pytest.skip("no Landlock on this kernel (docs/exercises.md: what holds without it)")
    out = sandbox_probe(PROBE % str(tmp_path / "written"))
    assert not (tmp_path / "written").exists()
    assert "('write', 'refused')" in out and "('parent memory', 'refused')" in out, out
    if "network and IPC namespaces" in out:
        assert "('udp', 'refused')" in out, out
    if "ABI 6" in out or "ABI 7" in out:
        assert "('signal parent', 'refused')" in out, out


def test_the_grader_fuzzer_refuses_its_cheap_cases_cleanly(tmp_path):
    """benchmarks/fuzz_grader.py (its full run prints the one line of totals): a file that
    writes outside, kills the grader, or writes garbage into the grader's pipe."""
    spec = importlib.util.spec_from_file_location(
        "fuzz_grader", ROOT / "benchmarks" / "fuzz_grader.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    cases = {case[0]: case for case in fuzz.CASES}
    for name in ("write a file outside", "kill the grader", "garbage into the grader's pipe"):
        _, exercise, source, _, seconds = cases[name]
        assert fuzz.run_case(name, exercise, source, seconds, tmp_path) == "refused cleanly"
