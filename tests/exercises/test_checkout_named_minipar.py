"""`git clone` of the project makes a folder named minipar/: the checkers must tell the
student's code from the library's by where the library is, not by a "/minipar/" in the
path (which every file of such a checkout has). And CI runs from such a folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HAND_IN = '''\
import threading

STOP = threading.Event()


def stuck(x, group=None):
    while not STOP.is_set():
        pass
    return x


def stub(x, group=None):
    raise NotImplementedError("ring_all_reduce: your code here")
'''

PROBE = '''\
import types

import hand_in
from exercises.checkers import find, harness
from exercises.solutions import ex01_ring_allreduce as solution

harness.CHECK_TIMEOUT = 0.3
for name in ("stuck", "stub"):
    impl = types.SimpleNamespace(ring_neighbours=solution.ring_neighbours,
                                 ring_all_reduce=getattr(hand_in, name))
    try:
        report = find("01").check(impl)
    finally:
        hand_in.STOP.set()
    runs = report.outcomes[1]
    print(name, runs.status, runs.detail.splitlines()[0])
'''


def test_the_checkers_find_the_students_code_in_a_checkout_named_minipar(tmp_path):
    """A student's function defined in <tmp>/minipar/hand_in.py, checked as an object (no
    file to compare frames with): a loop is named with its place, a stub is a TODO."""
    checkout = tmp_path / "minipar"
    checkout.mkdir()
    for package in ("exercises", "minipar"):
        (checkout / package).symlink_to(ROOT / package)
    (checkout / "hand_in.py").write_text(HAND_IN)
    (checkout / "probe.py").write_text(PROBE)
    result = subprocess.run([sys.executable, "probe.py"], cwd=checkout, capture_output=True,
                            text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(checkout)})
    assert result.returncode == 0, result.stderr
    stuck, stub = result.stdout.splitlines()
    assert stuck.startswith("stuck fail stuck() did not return within 0.3 s on rank(s) 0, 1 "
                            "(stuck at hand_in.py:7: while not STOP.is_set():)"), stuck
    assert stub == ("stub todo stub() still raises NotImplementedError (hand_in.py:13): "
                    "write it, then run the checker again"), stub


def test_ci_runs_the_suite_from_a_clone_in_a_folder_named_minipar():
    """.ci/run clones the checkout into <temporary>/minipar and runs everything there."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    clone = next(i for i, line in enumerate(lines) if line.startswith("git clone"))
    assert lines[clone].endswith('"$work/minipar"'), lines[clone]
    assert lines[clone + 1] == 'cd "$work/minipar"'
    assert all("pip install" not in line for line in lines[:clone])
