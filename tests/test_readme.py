"""The README's two opening commands are the ones that work (and the one CI runs)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)[:2]


def test_readme_opens_with_an_install_and_run_command_and_a_test_command():
    main, tests = readme_commands()
    assert "pip install" in main and "minipar " in main
    assert "pip install" in tests and "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_ci_lints_the_whole_tree():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "ruff check ." in ci
