"""The one command a student runs: `python -m exercises.check NN` (or
`python exercises/check.py NN`) prints a report and exits 0 only when every check passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exercises.check import main
from exercises.checkers import EXERCISES, find

ROOT = Path(__file__).resolve().parents[2]


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_module_command_on_a_stub_reports_todo_and_exits_1():
    result = run("-m", "exercises.check", "01")
    assert result.returncode == 1
    assert "TODO" in result.stdout and "ring_all_reduce() still raises" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_script_command_on_the_solution_passes():
    result = run("exercises/check.py", "ring_allreduce", "--solution")
    assert result.returncode == 0, result.stdout
    assert "All 8 checks pass." in result.stdout


def test_all_on_the_solutions_passes(capsys):
    assert main(["all", "--solution"]) == 0
    out = capsys.readouterr().out
    assert f"{len(EXERCISES)} of {len(EXERCISES)} exercises pass." in out


def test_listing_names_every_exercise_and_its_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for exercise in EXERCISES:
        assert f"exercises/{exercise.module}.py" in out
        assert f"python -m exercises.check {exercise.number}" in out


@pytest.mark.parametrize("key", ["5", "05", "ex05", "one_f_one_b", "exercises/ex05_one_f_one_b.py"])
def test_exercises_are_found_by_number_name_or_file(key):
    assert find(key).number == "05"


def test_an_unknown_exercise_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["99"])
    assert exit_info.value.code == 2
    assert "choose one of 01 (ring_allreduce)" in capsys.readouterr().err


def test_a_hand_in_that_does_not_import_is_one_clear_failure(tmp_path, capsys):
    broken = tmp_path / "ex03_data_parallel.py"
    broken.write_text("def train_step(model, optimizer, micro_batches, group)\n    pass\n")
    assert main(["03", "--file", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  the file imports" in out and "SyntaxError at line 1" in out


def test_a_hand_in_file_is_checked_in_place_of_the_student_file(tmp_path, capsys):
    solution = (ROOT / "exercises" / "solutions" / "ex05_one_f_one_b.py").read_text()
    hand_in = tmp_path / "alice.py"
    hand_in.write_text(solution)
    assert main(["05", "--file", str(hand_in)]) == 0
    assert "alice.py" in capsys.readouterr().out
