"""The suite runs every test file on disk (pytest skips some directory names by default,
e.g. 'dist', which would silently drop the minipar.dist tests)."""

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
