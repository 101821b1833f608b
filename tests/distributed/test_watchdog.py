"""The launch watchdog: nothing hangs. A rank stuck in its own code, a rank that swallows
the abort, a cycle of waits among some ranks while the others still run: each ends the
launch with an error that names the ranks, what they were doing and where."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from minipar import distributed as dist


def spin_forever(stop: threading.Event):
    """A student's infinite loop: pure Python, never calls minipar (until told to stop,
    so a failing test does not leave a busy thread behind)."""
    while not stop.is_set():
        pass


@pytest.fixture()
def stop():
    event = threading.Event()
    yield event
    event.set()


def live_rank_threads():
    """Rank threads still alive, after giving stopped ones up to 10 s to exit (a thread
    told to stop needs a moment to unwind; on a loaded machine more than 0.1 s)."""
    ranks = [t for t in threading.enumerate() if t.name.startswith("minipar-rank-")]
    for thread in ranks:
        thread.join(timeout=10)
    return [t.name for t in ranks if t.is_alive()]


def test_a_rank_stuck_in_its_own_loop_times_out_with_every_ranks_state(stop):
    def program():
        if dist.get_rank() == 0:
            dist.all_reduce(np.ones(2))  # one collective that completes, then the loop
            spin_forever(stop)
        dist.all_reduce(np.ones(2))
        return dist.all_reduce(np.ones(2))

    with pytest.raises(dist.LaunchTimeoutError) as info:
        dist.launch(program, 3, timeout=0.5)
    error, text = info.value, str(info.value)
    assert "rank 1 waited more than 0.5 s" in text or "rank 2 waited more than 0.5 s" in text
    assert ("rank 0: running (not in a collective or message); last collective or message: "
            "all_reduce(") in text
    assert "rank 1: waiting" in text and "all_reduce #1" in text and "for rank(s) 0" in text
    assert "in spin_forever" in text  # rank 0's Python stack, down to the loop
    names = [f.name for f in error.stacks[0]]  # from the rank function down
    assert names[0] == "program" and "spin_forever" in names
    assert error.timeout == 0.5 and error.left_running == []
    assert live_rank_threads() == []  # the stuck rank was stopped, not left spinning


def test_no_progress_at_all_times_out_too(stop):
    with pytest.raises(dist.LaunchTimeoutError, match="no rank computed, communicated or "
                                                      "returned for 0.3 s"):
        dist.launch(spin_forever, 1, stop, timeout=0.3)


def test_a_rank_that_swallows_the_abort_does_not_hang_the_launch(stop):
    """Rank 1 fails; rank 0 catches the abort (a BaseException) and then loops on: the
    launch still raises rank 1's error, after stopping rank 0 from outside."""
    def program():
        if dist.get_rank() == 1:
            raise ValueError("rank 1 is broken")
        try:
            dist.barrier()
        except BaseException:  # noqa: BLE001 - what a careless retry loop does
            spin_forever(stop)

    with pytest.raises(ValueError, match="rank 1 is broken"):
        dist.launch(program, 2, timeout=60)
    assert live_rank_threads() == []


def test_a_rank_that_keeps_retrying_is_left_as_a_daemon_and_said_so(stop):
    def program():
        if dist.get_rank() == 1:
            raise ValueError("rank 1 is broken")
        while not stop.is_set():
            try:
                spin_forever(stop)
            except BaseException:  # noqa: BLE001 - swallows even the watchdog's RankAborted
                pass

    with pytest.raises(ValueError, match="rank 1 is broken") as info:
        dist.launch(program, 2, timeout=60)
    assert any("rank(s) 0 did not stop after the abort and were left running as daemon "
               "threads" in note for note in info.value.__notes__)
    stop.set()
    assert live_rank_threads() == []


def test_a_cycle_among_some_ranks_is_reported_while_the_others_still_run():
    """Ranks 0 and 1 both recv first; ranks 2 and 3 compute for up to a minute. The
    deadlock is reported as soon as 0 and 1 wait, and 2 and 3 are stopped mid-way."""
    finished = []

    def program():
        rank = dist.get_rank()
        if rank < 2:
            return dist.recv(1 - rank)
        for _ in range(6000):  # ~60 s of "compute" unless the launch is aborted first
            time.sleep(0.01)
        finished.append(rank)

    with pytest.raises(dist.DeadlockError, match=r"rank 0 waits recv from 1.*rank 1 waits "
                                                 r"recv from 0.*a cycle among ranks [01], [01]; "
                                                 r"rank\(s\) 2, 3 are not part of it"):
        dist.launch(program, 4, timeout=600)
    assert finished == []


def test_a_cycle_through_a_collective_is_reported_too():
    """Rank 0 waits in a barrier of {0, 1} for rank 1, which waits to receive from rank
    0: a cycle through a collective and a message, while rank 2 still runs."""
    finished = []

    def program():
        rank = dist.get_rank()
        pair = dist.new_group([0, 1])
        if rank == 0:
            dist.barrier(group=pair)
        elif rank == 1:
            dist.recv(0)
        else:
            for _ in range(6000):
                time.sleep(0.01)
            finished.append(rank)

    with pytest.raises(dist.DeadlockError, match=r"rank 0 waits barrier #0 .* for rank\(s\) "
                                                 r"1; rank 1 waits recv from 0"):
        dist.launch(program, 3, timeout=600)
    assert finished == []


def test_a_cycle_is_reported_while_a_rank_sits_in_one_long_call():
    """Ranks 0 and 1 recv from each other while rank 2 sits in one long C call, which no
    exception interrupts (an Event.wait: a time.sleep the test can end early). The launch
    gives up on such a rank within a second (launch.py: ABORT_GRACE + ASYNC_ABORTS x
    ASYNC_GRACE) and raises the deadlock while rank 2 is still in its call; 3.5 s leaves
    a loaded machine 2.5 s of slack."""
    released, finished = threading.Event(), threading.Event()

    def program():
        rank = dist.get_rank()
        if rank == 2:
            try:
                released.wait(3.5)
            finally:
                finished.set()
            return None
        return dist.recv(1 - rank)

    with pytest.raises(dist.DeadlockError, match=r"rank 0 waits recv from 1.*rank 1 waits "
                                                 r"recv from 0.*rank\(s\) 2 are not part "
                                                 r"of it") as info:
        dist.launch(program, 3, timeout=600)
    rank_2_was_in_its_call = not finished.is_set()
    released.set()  # end the call: the rank stops at its next bytecode
    assert rank_2_was_in_its_call
    assert any("rank(s) 2 did not stop after the abort and were left running as daemon "
               "threads" in note for note in info.value.__notes__)
    assert live_rank_threads() == []


def test_the_timeout_comes_from_the_argument_the_scope_or_the_environment(monkeypatch, stop):
    assert dist.launch(lambda: 1, 1) == [1]
    from minipar.distributed.launch import DEFAULT_TIMEOUT, resolve_timeout

    assert resolve_timeout() == DEFAULT_TIMEOUT == 600
    monkeypatch.setenv("MINIPAR_LAUNCH_TIMEOUT", "0.3")
    assert resolve_timeout() == 0.3
    with dist.launch_timeout(5):
        assert resolve_timeout() == 5 and resolve_timeout(2) == 2
        with pytest.raises(dist.LaunchTimeoutError, match="for 0.2 s"):
            dist.launch(spin_forever, 1, stop, timeout=0.2)
    with pytest.raises(dist.LaunchTimeoutError, match="for 0.3 s"):
        dist.launch(spin_forever, 1, stop)
    monkeypatch.setenv("MINIPAR_LAUNCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MINIPAR_LAUNCH_TIMEOUT must be a number of seconds"):
        dist.launch(lambda: 1, 1)
    for bad in (0, -1, float("nan"), "10"):
        with pytest.raises(ValueError, match=r"launch\(timeout=...\) must be"):
            dist.launch(lambda: 1, 1, timeout=bad)


def test_the_cli_turns_a_timeout_into_one_line(monkeypatch, capsys, stop):
    from minipar import cli

    def stuck(args):
        dist.launch(spin_forever, 1, stop, timeout=0.2)

    monkeypatch.setitem(cli.__dict__, "cmd_consolidate", stuck)
    assert cli.main(["consolidate", "a", "b.npz"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "launch timed out" in err and "spin_forever" in err
