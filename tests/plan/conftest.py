"""Fixtures of the planner's tests."""

from __future__ import annotations

import pytest

from minipar.plan.cli import main


@pytest.fixture
def plan_cli(capsys):
    """`minipar plan ARGV...` in this process: plan_cli(*argv) -> (exit status, stdout,
    stderr)."""
    def run(*argv):
        status = main(["plan", *argv])
        out, err = capsys.readouterr()
        return status, out, err
    return run
