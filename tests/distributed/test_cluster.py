"""Nothing hangs: mismatched collectives and deadlocks become errors within a second,
naming what every rank called or waits for."""

from __future__ import annotations

import importlib
import time

import numpy as np
import pytest

from minipar import distributed as dist

# (the package's `launch` is the function; its module holds the abort constants)
launch_module = importlib.import_module("minipar.distributed.launch")


def run_expecting(error_type, fn, n, match=None):
    """Launch fn on n ranks; it must raise error_type, found where the ranks meet, not by
    the watchdog (which would raise LaunchTimeoutError, and only after a minute). Returns
    the message."""
    with pytest.raises(error_type, match=match) as info:
        dist.launch(fn, n, timeout=60)
    return str(info.value)


# --- collective mismatches -------------------------------------------------------------------
def test_different_collectives_list_every_rank_call():
    def worker():
        x = np.zeros(4, np.float32)
        if dist.get_rank() == 1:
            return dist.all_gather(x)
        return dist.all_reduce(x)

    message = run_expecting(dist.CollectiveMismatchError, worker, 3)
    assert "rank 0: all_reduce(shape=(4,), dtype=float32, op='sum')" in message
    assert "rank 1: all_gather(shape=(4,), dtype=float32, dim=0)" in message
    assert "rank 2: all_reduce" in message


@pytest.mark.parametrize(
    "odd_call, expected",
    [
        (lambda: dist.all_reduce(np.zeros(5, np.float32)), "shape=(5,)"),
        (lambda: dist.all_reduce(np.zeros(4, np.float64)), "dtype=float64"),
        (lambda: dist.all_reduce(np.zeros(4, np.float32), op="max"), "op='max'"),
        (lambda: dist.broadcast(np.zeros(4, np.float32), src=1), "src=1"),
        (lambda: dist.all_gather(np.zeros((4, 1), np.float32), dim=1), "dim=1"),
    ],
)
def test_same_collective_with_different_arguments(odd_call, expected):
    normal = {
        "shape=(5,)": lambda: dist.all_reduce(np.zeros(4, np.float32)),
        "dtype=float64": lambda: dist.all_reduce(np.zeros(4, np.float32)),
        "op='max'": lambda: dist.all_reduce(np.zeros(4, np.float32)),
        "src=1": lambda: dist.broadcast(np.zeros(4, np.float32), src=0),
        "dim=1": lambda: dist.all_gather(np.zeros((4, 1), np.float32), dim=0),
    }[expected]

    def worker():
        return odd_call() if dist.get_rank() == 2 else normal()

    message = run_expecting(dist.CollectiveMismatchError, worker, 4)
    assert "rank 2: " in message and expected in message.split("rank 2: ")[1].split("\n")[0]


def test_same_ranks_different_group_kind_is_a_mismatch():
    def worker():
        kind = "dp" if dist.get_rank() == 0 else "tp"
        return dist.all_reduce(np.zeros(2), group=dist.new_group([0, 1], kind=kind))

    message = run_expecting(dist.CollectiveMismatchError, worker, 2)
    assert "dp group [0, 1]" in message and "tp group [0, 1]" in message


def test_overlapping_groups_that_never_complete_are_a_mismatch():
    # Each rank waits in a different 2-rank group: no group ever gets both members.
    def worker():
        rank = dist.get_rank()
        return dist.all_reduce(np.zeros(2), group=dist.new_group([rank, (rank + 1) % 3]))

    message = run_expecting(dist.CollectiveMismatchError, worker, 3)
    for line in ("rank 0: all_reduce", "rank 1: all_reduce", "rank 2: all_reduce"):
        assert line in message
    assert "group [0, 1]" in message and "group [1, 2]" in message


def test_collectives_in_a_different_order():
    def worker():
        x = np.zeros(3)
        if dist.get_rank() == 0:
            dist.all_reduce(x)
            dist.barrier()
        else:
            dist.barrier()
            dist.all_reduce(x)

    message = run_expecting(dist.CollectiveMismatchError, worker, 2)
    assert "rank 0: all_reduce" in message and "rank 1: barrier" in message


# --- deadlocks -------------------------------------------------------------------------------
def test_recv_cycle_names_the_wait_for_graph():
    def worker():
        return dist.recv(1 - dist.get_rank())

    message = run_expecting(dist.DeadlockError, worker, 2)
    assert "rank 0 waits recv from 1" in message and "rank 1 waits recv from 0" in message


def test_crossed_blocking_sends_deadlock():
    def worker():
        peer = 1 - dist.get_rank()
        dist.send(np.zeros(2), peer)
        return dist.recv(peer)

    message = run_expecting(dist.DeadlockError, worker, 2)
    assert "rank 0 waits send to 1" in message and "rank 1 waits send to 0" in message


def test_recv_from_a_rank_that_returned():
    def worker():
        if dist.get_rank() == 0:
            return dist.recv(1)

    message = run_expecting(dist.DeadlockError, worker, 3)
    assert "rank 0 waits recv from 1" in message and "rank 1 has returned" in message


def test_send_that_nobody_receives():
    def worker():
        if dist.get_rank() == 0:
            dist.isend(np.zeros(2), 1)  # never waited: checked when rank 0 returns

    message = run_expecting(dist.DeadlockError, worker, 2)
    assert "rank 0 waits send to 1" in message


def test_collective_missing_a_rank_that_returned():
    def worker():
        if dist.get_rank() != 2:
            dist.all_reduce(np.zeros(2))

    message = run_expecting(dist.DeadlockError, worker, 3)
    assert "rank 2 has returned" in message and "for rank(s) 2" in message


def test_mixed_collective_and_recv_deadlock():
    def worker():
        if dist.get_rank() == 0:
            dist.barrier()
        else:
            dist.recv(0)

    message = run_expecting(dist.DeadlockError, worker, 2)
    assert "rank 1 waits recv from 0" in message and "rank 0 waits barrier" in message


def test_deadlock_is_detected_while_other_ranks_still_compute():
    # Ranks 0 and 1 wait on each other while rank 2 is busy: a cycle, whatever rank 2 does.
    def worker():
        rank = dist.get_rank()
        if rank == 2:
            time.sleep(0.2)
            return "done"
        return dist.recv(1 - rank)

    message = run_expecting(dist.DeadlockError, worker, 3)
    assert "rank 0 waits recv from 1" in message


# --- no false positives: waiting for a rank that is busy, or slow, is not a deadlock -----
def test_a_chain_of_waits_ending_at_a_busy_rank_is_not_a_deadlock():
    """Rank 0 waits for 1, which waits for 2, which computes (sleeps, holding the turn if
    it has it, long past PATIENCE_S) before it sends: every rank waits but one, and no
    wait closes a cycle. Then each passes the message on, plus one."""
    def worker():
        rank = dist.get_rank()
        if rank == 2:
            time.sleep(0.3)
            dist.send(np.zeros(1), 1)
            return dist.recv(0)[0]
        x = dist.recv(rank + 1) + 1
        dist.send(x, (rank - 1) % 3)
        return x[0]

    assert dist.launch(worker, 3, timeout=60) == [2.0, 1.0, 2.0]


def test_ranks_that_wait_for_each_other_in_turn_are_not_a_cycle():
    """Ranks 0 and 1 each wait for the other in turn (20 all_reduces of their pair) while
    rank 2 is slow to join the world's all_reduce: at no instant do two ranks wait on
    each other."""
    def worker():
        rank = dist.get_rank()
        pair = dist.new_group([0, 1])
        x = np.ones(1)
        if rank == 2:
            time.sleep(0.3)
        else:
            for _ in range(20):
                x = dist.all_reduce(x, group=pair) / 2
        return dist.all_reduce(x)[0]

    assert dist.launch(worker, 3, timeout=60) == [3.0, 3.0, 3.0]


# --- exceptions ------------------------------------------------------------------------------
def test_exception_in_one_rank_aborts_the_others_and_names_the_rank(monkeypatch):
    # No last resort (RankAborted raised into a thread) and a long grace: a rank that
    # does not stop by itself at its next call into minipar is left running, and said so.
    monkeypatch.setattr(launch_module, "ASYNC_ABORTS", 0)
    monkeypatch.setattr(launch_module, "ABORT_GRACE", 10.0)
    computed = [0]

    def worker():
        rank = dist.get_rank()
        if rank == 2:
            raise ValueError("bad shard")
        if rank == 3:  # computing: stopped at its next compute call
            for step in range(10_000_000):  # (seconds, if nothing stopped it)
                computed[0] = step
                dist.get_device().compute(1.0, "forward")
        return dist.all_reduce(np.zeros(2))  # blocked: woken and stopped

    with pytest.raises(ValueError, match="bad shard") as info:
        dist.launch(worker, 4)
    assert info.value.rank == 2
    assert "raised on rank 2 of 4" in info.value.__notes__[-1]
    assert not any("left running" in note for note in info.value.__notes__)
    assert computed[0] < 9_999_999  # stopped by the abort, not by the end of its loop


def test_a_failed_launch_leaks_nothing_into_the_next():
    from minipar.autograd.tracking import current_device

    with pytest.raises(ZeroDivisionError):
        dist.launch(lambda: 1 / 0 if dist.get_rank() == 1 else dist.barrier(), 2)
    with pytest.raises(dist.DeadlockError):
        dist.launch(lambda: dist.recv(1 - dist.get_rank()), 2)
    assert current_device() is None
    with pytest.raises(RuntimeError, match="outside a virtual rank"):
        dist.get_rank()
    results, devices = dist.launch(
        lambda: (dist.get_rank(), dist.all_reduce(np.ones(1))), 3, return_devices=True
    )
    assert [(r, float(x[0])) for r, x in results] == [(0, 3.0), (1, 3.0), (2, 3.0)]
    assert all(d.comm.calls == 1 for d in devices)
