"""Every checker fails on its student stub and passes on its reference solution.

The stub run is a strict xfail that must raise NotImplementedError: a stub that still
says "not implemented" is the expected failure; a student file into which a solution
leaked passes, and strict turns that XPASS into a failure; a checker that fails the stub
for any other reason (an AssertionError here) fails too."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from exercises.checkers import EXERCISES

ROOT = Path(__file__).resolve().parents[2]
EXERCISES_DIR = ROOT / "exercises"
IDS = [f"{e.number}-{e.slug}" for e in EXERCISES]


def student(exercise):
    return importlib.import_module(f"exercises.{exercise.module}")


def solution(exercise):
    return importlib.import_module(f"exercises.solutions.{exercise.module}")


@pytest.mark.xfail(strict=True, raises=NotImplementedError,
                   reason="the student file is a stub: its checker must say so")
@pytest.mark.parametrize("exercise", EXERCISES, ids=IDS)
def test_checker_fails_on_the_stub(exercise):
    report = exercise.check(student(exercise))
    failed = [o for o in report.outcomes if o.status == "fail"]
    # A stub is "not written yet", never "wrong": no FAIL that would confuse a student.
    assert not failed, report.render()
    if report.not_implemented:
        raise NotImplementedError(report.render())
    assert report.passed, report.render()


@pytest.mark.parametrize("exercise", EXERCISES, ids=IDS)
def test_checker_passes_on_the_solution(exercise):
    report = exercise.check(solution(exercise))
    assert report.passed, report.render()
    assert all(o.status == "pass" for o in report.outcomes), report.render()  # no warnings


@pytest.mark.parametrize("exercise", EXERCISES, ids=IDS)
def test_stub_report_names_the_stubs_and_shows_no_traceback(exercise):
    text = exercise.check(student(exercise)).render()
    assert "still raises NotImplementedError" in text
    assert f"{exercise.module}.py:" in text  # file and line of the stub
    assert "Traceback" not in text


def public_names(path: Path) -> dict[str, list[str]]:
    """Top-level functions and classes (with their methods) of a file."""
    names = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            names[node.name] = [a.arg for a in node.args.args]
        elif isinstance(node, ast.ClassDef):
            names[node.name] = sorted(n.name for n in node.body
                                      if isinstance(n, ast.FunctionDef))
    return names


@pytest.mark.parametrize("exercise", EXERCISES, ids=IDS)
def test_solution_has_the_student_files_api(exercise):
    stub = public_names(EXERCISES_DIR / f"{exercise.module}.py")
    reference = public_names(EXERCISES_DIR / "solutions" / f"{exercise.module}.py")
    assert stub == reference


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_solutions_are_kept_apart():
    """Student files and checkers never import the solutions (a handout leaves them out),
    and every exercise has its student file, solution and checker."""
    outside = [p for p in EXERCISES_DIR.rglob("*.py") if "solutions" not in p.parts]
    for path in outside:
        assert not any("solutions" in name for name in imports(path)), path
    for exercise in EXERCISES:
        for folder in ("", "solutions/", "checkers/"):
            assert (EXERCISES_DIR / f"{folder}{exercise.module}.py").is_file()
    numbers = [e.number for e in EXERCISES]
    assert numbers == [f"{i:02d}" for i in range(1, len(EXERCISES) + 1)]


def test_the_teachers_pages_list_every_exercise():
    """docs/exercises.md and exercises/README.md each have a table row per exercise, and
    the teachers' page says how many there are (it said six when there were seven)."""
    words = {6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven",
             12: "twelve", 13: "thirteen"}
    for page in (ROOT / "docs" / "exercises.md", EXERCISES_DIR / "README.md"):
        text = page.read_text()
        rows = [line.split("|")[1].strip() for line in text.splitlines()
                if line.startswith("| 0") or line.startswith("| 1")]
        assert rows == [e.number for e in EXERCISES], page.name
        count = words.get(len(EXERCISES), str(len(EXERCISES)))
        assert f"{count} classroom exercises" in text.lower(), page.name


def test_the_readme_says_what_every_checker_measures():
    """exercises/README.md's "What each checker measures" has one entry per exercise, in
    order (it stopped at 06 when 07 was added)."""
    text = (EXERCISES_DIR / "README.md").read_text()
    section = text.split("### What each checker measures", 1)[1].split("\n#", 1)[0]
    entries = [line[len("- **"):].split("**", 1)[0] for line in section.splitlines()
               if line.startswith("- **")]
    assert entries == [e.number for e in EXERCISES]
