"""The report a student reads: statuses, sentences instead of tracebacks, and the refusal
of the library's ready-made answers."""

from __future__ import annotations

import types

import pytest

from exercises.checkers.harness import (
    CheckFailed,
    CheckWarning,
    Outcome,
    Report,
    start_report,
)
from exercises.checkers.source_check import forbidden_uses
from minipar import distributed as dist


@pytest.fixture
def stub_module(tmp_path):
    path = tmp_path / "student.py"
    path.write_text(
        "from minipar import distributed as dist\n"
        "from minipar.parallel.pipeline.schedules import one_f_one_b\n\n"
        "def one_f_one_b_mine(pp, m):\n"
        '    """uses all_reduce only in this docstring"""\n'
        "    return dist.all_reduce(pp)\n\n"
        "def todo(x):\n"
        "    raise NotImplementedError('your code here')\n\n"
        "def explode():\n"
        "    raise KeyError('planted')\n")
    namespace = {"__file__": str(path), "__name__": "student"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102
    return types.SimpleNamespace(**namespace)


def test_a_stub_in_the_file_under_test_is_todo_with_its_place(stub_module):
    report = start_report("00", "demo", stub_module)
    report.run("first", stub_module.todo, 1)
    report.run("second", lambda: None)
    (todo, ok) = report.outcomes
    assert todo.status == "todo" and ok.status == "pass"
    assert todo.detail.startswith("todo() still raises NotImplementedError (student.py:9)")
    assert report.not_implemented and not report.passed
    assert "1 of 2 checks pass; still to write: todo()" in report.render()


def test_not_implemented_elsewhere_is_a_failure_not_a_todo(stub_module):
    def library_limit():  # e.g. minipar's training loop refusing a setting
        raise NotImplementedError("this build trains with data parallelism only")

    report = start_report("00", "demo", stub_module)
    report.run("uses a library limit", library_limit)
    assert report.outcomes[0].status == "fail"
    assert "NotImplementedError: this build trains" in report.outcomes[0].detail
    assert not report.not_implemented


def test_errors_become_one_paragraph_with_file_line_and_rank(stub_module):
    def program():
        if dist.get_rank() == 1:
            stub_module.explode()

    report = start_report("00", "demo", stub_module)
    report.run("ranks", lambda: dist.launch(program, 2))
    (outcome,) = report.outcomes
    assert outcome.status == "fail"
    assert outcome.detail.splitlines() == [
        "KeyError: 'planted'",
        "  at student.py:12 in explode(): raise KeyError('planted')",
        "  (raised on rank 1)"]


def test_failures_warnings_and_skips_render_and_count():
    report = Report("07", "demo", "x.py")

    def fails():
        raise CheckFailed("expected 48 bytes, got 96")

    def warns():
        raise CheckWarning("correct but slow")

    report.run("a", fails)
    report.run("b", warns)
    report.skip("c", "needs a")
    text = report.render()
    assert "FAIL  a\n        expected 48 bytes, got 96" in text
    assert "warn  b" in text and "skip  c (needs a)" in text
    assert report.counts() == (1, 3)
    assert not report.passed
    good = Report("07", "demo", "x.py")
    good.run("b", warns)
    assert good.passed and "All 1 checks pass (1 with a warning)." in good.render()


def test_forbidden_uses_finds_imports_and_attributes_not_own_names_or_docstrings(
        stub_module):
    found = forbidden_uses(stub_module, {"one_f_one_b": "library", "all_reduce": "library",
                                         "minipar.parallel": "library"})
    assert found == ["minipar.parallel.pipeline.schedules (line 2): library",
                     "one_f_one_b (line 2): library",
                     "all_reduce (line 6): library"]
    assert forbidden_uses(types.SimpleNamespace(), {"x": "y"}) == []  # no file: no check


@pytest.mark.parametrize("statuses, summary", [
    ((("fail", False),), "1 fail. Fix the first FAIL above"),
    ((("fail", True), ("skip", False)), "1 ERROR. Fix the first ERROR above"),
    ((("fail", True), ("fail", False)), "1 fail, 1 ERROR. Fix the first FAIL or ERROR above"),
])
def test_the_summary_names_the_label_of_what_failed(statuses, summary):
    """"Fix the first FAIL above" under a report whose only problem reads ERROR sent the
    student looking for a FAIL that is not there."""
    report = Report("01", "demo", "x.py")
    report.run("passes", lambda: None)
    for k, (status, raised) in enumerate(statuses):
        report.outcomes.append(Outcome(status, f"check {k}", "why", raised=raised))
    assert report.render().splitlines()[-1] == (
        f"1 of {len(statuses) + 1} checks pass, {summary} and run the checker again.")


def test_an_error_of_the_code_under_test_ends_with_fix_the_first_error(stub_module):
    report = start_report("00", "demo", stub_module)
    report.run("explodes", stub_module.explode)
    (outcome,) = report.outcomes
    assert outcome.raised
    assert "ERROR your code raised KeyError" in report.render()
    assert report.render().endswith(
        "0 of 1 checks pass, 1 ERROR. Fix the first ERROR above and run the checker again.")
