"""The suite runs every test file on disk (pytest skips some directory names by default,
e.g. 'dist' or 'build': no test directory may be named so, and none is lost if one is)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_file_is_collected(request):
    if request.config.args and any(Path(a).resolve() != TESTS and "::" not in a
                                   for a in request.config.args):
        import pytest

        pytest.skip("a subset of the suite was selected")
    on_disk = {p.resolve() for p in TESTS.rglob("test_*.py")}
    collected = {Path(item.path).resolve() for item in request.session.items}
    missing = sorted(str(p.relative_to(TESTS)) for p in on_disk - collected)
    assert not missing, f"test files pytest did not collect: {missing}"


def test_ruff_lints_every_python_file_in_the_repository():
    """ruff skips some directory names by default (e.g. 'dist', 'build'): CI's
    `ruff check .` must see every tracked Python file."""
    import shutil
    import subprocess

    import pytest

    root = TESTS.parent
    if shutil.which("ruff") is None or not (root / ".git").exists():
        pytest.skip("needs ruff and a git checkout")
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.split()
    shown = subprocess.run(["ruff", "check", "--show-files", "."], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    linted = {str(Path(p).resolve().relative_to(root)) for p in shown if p.endswith(".py")}
    missing = sorted(set(tracked) - linted)
    assert not missing, f"ruff does not lint: {missing}"
