"""launch: one thread per rank, results by rank, rank and world size inside."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import threadpoolctl

from minipar import distributed as dist


def test_results_by_rank_args_and_kwargs():
    def worker(a, b=0):
        return (dist.get_rank(), dist.get_world_size(), a, b, threading.current_thread().name)

    results = dist.launch(worker, 3, "x", b=5)
    assert [r[:4] for r in results] == [(r, 3, "x", 5) for r in range(3)]
    assert len({r[4] for r in results}) == 3  # a thread per rank


def test_get_rank_within_a_group():
    def worker():
        group = dist.new_group([1, 2])
        return dist.get_rank(group) if dist.get_rank() in group else None, dist.get_world_size(
            group
        )

    assert dist.launch(worker, 3) == [(None, 2), (0, 2), (1, 2)]


def test_back_to_back_launches_are_independent():
    first, devices_a = dist.launch(lambda: dist.all_reduce(np.ones(2)), 2, return_devices=True)
    second, devices_b = dist.launch(lambda: dist.all_reduce(np.ones(2)), 4, return_devices=True)
    assert float(first[0][0]) == 2.0 and float(second[0][0]) == 4.0
    assert all(d.comm.calls == 1 for d in devices_a + devices_b)
    assert devices_a[0] is not devices_b[0]


def test_each_rank_multiplies_on_one_blas_thread():
    """launch limits NumPy's BLAS to one thread (the ranks are the parallelism; without
    it a 16-rank step ran ~25x slower). threadpoolctl must see that BLAS to limit it:
    3.1 does not see NumPy 2's scipy-openblas: the demo took 12 s instead of 10 on
    idle cores, 80 s instead of 15 beside two busy processes."""
    built_with = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    if "accelerate" in built_with.lower():  # macOS: a pool threadpoolctl cannot size
        pytest.skip(f"NumPy uses {built_with}, which threadpoolctl does not control")

    def blas_threads():
        return [(pool["internal_api"], pool["num_threads"])
                for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]

    outside = blas_threads()
    assert outside, (f"threadpoolctl {threadpoolctl.__version__} finds no BLAS in NumPy "
                     f"{np.__version__} (built with {built_with})")
    if all(threads == 1 for _, threads in outside):  # a one-core machine: nothing to limit
        pytest.skip("NumPy's BLAS runs one thread here already")
    inside = dist.launch(blas_threads, 2)
    assert all(threads == 1 for _, threads in inside[0] + inside[1])
    assert blas_threads() == outside  # and given back after the launch


def test_nested_launch_inside_a_rank_is_refused():
    """A launch inside a rank would run a cluster inside one GPU, whose traffic and memory
    no report would show: it is a mistake, said at once."""
    import pytest

    def inner():
        return dist.get_rank()

    def outer():
        return dist.launch(inner, 2)

    with pytest.raises(dist.DistError, match=r"launch\(\) was called inside virtual rank [01]"):
        dist.launch(outer, 2)


def test_bad_world_size():
    import pytest

    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        dist.launch(lambda: None, 0)


def _barriers_until_stopped(started: threading.Event, rounds: int = 10**6):
    """A rank that communicates for as long as it is let (a run nobody waits for)."""
    started.set()
    for _ in range(rounds):
        dist.barrier()
    return "finished"


def test_a_cancellation_stops_a_running_launch_from_another_thread():
    import pytest

    started, cancellation = threading.Event(), dist.Cancellation()
    before = set(threading.enumerate())
    threading.Thread(target=lambda: (started.wait(10), cancellation.cancel())).start()
    with pytest.raises(dist.LaunchCancelled, match="cancelled"), cancellation:
        dist.launch(_barriers_until_stopped, 4, started)
    assert cancellation.cancelled
    assert not [t for t in set(threading.enumerate()) - before  # every rank stopped
                if t.name.startswith("minipar-rank-")]
    with pytest.raises(dist.LaunchCancelled, match="not started"), cancellation:
        dist.launch(lambda: None, 2)  # cancelled already: refused at once
    assert dist.launch(lambda: 7, 2) == [7, 7]  # outside the block: not affected


def test_a_cancellation_stops_only_the_launches_of_the_thread_in_its_block():
    cancellation, started, results = dist.Cancellation(), threading.Event(), []
    other = threading.Thread(target=lambda: results.append(
        dist.launch(_barriers_until_stopped, 2, started, rounds=200)))
    with cancellation:
        other.start()  # launches in its own thread, outside this thread's block
        started.wait(10)
        cancellation.cancel()
        other.join(30)
    assert results == [["finished", "finished"]]
