"""A student handout has the student files and checkers, and no solutions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from exercises.checkers import EXERCISES
from exercises.handout import make_handout


def test_handout_leaves_out_the_solutions_and_its_checkers_still_run(tmp_path):
    target = make_handout(tmp_path)
    assert not (target / "solutions").exists()
    for exercise in EXERCISES:
        assert (target / f"{exercise.module}.py").is_file()
        assert (target / "checkers" / f"{exercise.module}.py").is_file()
    check = [sys.executable, "-m", "exercises.check", "05"]
    stub = subprocess.run(check, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert stub.returncode == 1 and "TODO" in stub.stdout
    teacher = subprocess.run(check + ["--solution"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    assert teacher.returncode == 2
    assert "not part of this copy" in teacher.stderr


def test_handout_refuses_to_overwrite(tmp_path):
    make_handout(tmp_path)
    with pytest.raises(FileExistsError):
        make_handout(tmp_path)
