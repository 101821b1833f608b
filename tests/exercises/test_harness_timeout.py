"""A student's function that never returns does not hang the checker: the check fails
after the harness's short launch timeout, naming the function and where it is stuck."""

from __future__ import annotations

import importlib
import threading
import types

from exercises.checkers import find, harness
from minipar import distributed as dist

STOP = threading.Event()  # lets a failing test's spinning thread end


def ring_all_reduce(x, group=None):
    """A student's ring that forgot to advance its loop counter."""
    step = 0
    while step < 1 and not STOP.is_set():
        pass
    return x


def test_an_infinite_loop_is_a_failure_naming_the_function(monkeypatch):
    monkeypatch.setattr(harness, "CHECK_TIMEOUT", 0.3)
    solution = importlib.import_module("exercises.solutions.ex01_ring_allreduce")
    names = {k: getattr(solution, k) for k in dir(solution) if not k.startswith("__")}
    impl = types.SimpleNamespace(**{**names, "ring_all_reduce": ring_all_reduce})
    try:
        report = find("01").check(impl)
    finally:
        STOP.set()
    failed = [o for o in report.outcomes if o.status == "fail"]
    assert failed, report.render()
    detail = failed[0].detail
    assert "ring_all_reduce() did not return within 0.3 s on rank(s) 0, 1" in detail
    assert "test_harness_timeout.py" in detail and "while step < 1" in detail


def test_checks_run_under_the_short_timeout():
    from minipar.distributed.launch import resolve_timeout

    report = harness.start_report("00", "probe", types.SimpleNamespace())
    seen = report.run("probe", resolve_timeout)  # what a launch in the check would use
    assert seen == harness.CHECK_TIMEOUT < dist.DEFAULT_TIMEOUT == resolve_timeout()
