"""Turns: one rank runs at a time, a rank that waited too long runs anyway, and nothing a
run measures depends on them."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np

from minipar import distributed as dist
from minipar.distributed import turns
from minipar.distributed.turns import Turns


def test_one_rank_has_the_turn_and_a_rank_out_of_patience_runs_without_it(monkeypatch):
    monkeypatch.setattr(turns, "PATIENCE_S", 0.01)
    ranks = Turns(3)
    ranks.take(0)
    ranks.take(1)  # rank 0 has it: rank 1 runs anyway, without it
    assert ranks._has_turn == [True, False, False]
    ranks.give_back(1)  # giving back what it does not have frees nothing
    ranks.take(2)
    assert ranks._has_turn == [True, False, False]
    ranks.give_back(0)
    ranks.take(2)
    assert ranks._has_turn == [False, False, True]


def test_every_rank_gives_its_turn_back_when_it_waits_and_when_it_returns():
    """A ring of messages and collectives over 4 ranks completes (each wait hands the turn
    on), and afterwards no rank holds it."""
    def program():
        # even ranks send to their successor then receive; odd ranks receive, then pass on
        # what they got, plus one: rank r ends with what rank r - 1 sent
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank % 2 == 0:
            dist.send(np.full(2, float(rank)), (rank + 1) % world)
            got = dist.recv((rank - 1) % world)
        else:
            got = dist.recv((rank - 1) % world)
            dist.send(got + 1, (rank + 1) % world)
        return dist.all_reduce(got).tolist()

    results, devices = dist.launch(program, 4, return_devices=True)
    # rank 1 got 0, rank 2 got 0 + 1, rank 3 got 2, rank 0 got 2 + 1
    assert results == [[6.0, 6.0]] * 4
    assert devices[0]._cluster.turns._has_turn == [False] * 4


def test_a_rank_queued_behind_others_keeps_waiting_while_the_turn_changes_hands(monkeypatch):
    """Eight ranks each run 0.4 x PATIENCE_S before their first collective: the last one
    waits 2.8 x PATIENCE_S for the turn, but the turn changed hands every 0.4 x, so every
    rank still runs with it (counting the patience from when a rank began to wait, ranks
    3-7 ran out of it and all ran at once: 18-21k context switches in a dp=8 step of the
    explorers' model instead of ~200)."""
    monkeypatch.setattr(turns, "PATIENCE_S", 0.1)
    took: list[tuple[int, bool]] = []
    original = Turns.take

    def take(self, rank):
        original(self, rank)
        took.append((rank, self._has_turn[rank]))

    monkeypatch.setattr(Turns, "take", take)

    def program():
        time.sleep(0.04)  # the rank's own work, holding the turn
        return dist.all_reduce(np.ones(1)).tolist()

    assert dist.launch(program, 8) == [[8.0]] * 8
    assert len({rank for rank, _ in took}) == 8
    assert all(with_turn for _, with_turn in took), took


class RecordingLock:
    """A lock that records how each acquire waited: its timeout, or None (it did not)."""

    def __init__(self) -> None:
        self._lock, self.waits = threading.Lock(), []

    def acquire(self, blocking=True, timeout=-1):
        self.waits.append(timeout if blocking else None)
        return self._lock.acquire(blocking, timeout)

    def release(self):
        self._lock.release()


def test_a_stuck_turn_is_not_queued_for_again_until_it_changes_hands(monkeypatch):
    """Rank 2 keeps the turn (asleep in a long call): ranks queue for it (and run without
    it after PATIENCE_S) until it has stayed with rank 2 for STUCK_S; from then on nobody
    waits for it until it changes hands, and then ranks queue again."""
    clock = SimpleNamespace(now=0.0)  # the Turns' clock, moved by hand
    monkeypatch.setattr(turns, "time", SimpleNamespace(monotonic=lambda: clock.now))
    monkeypatch.setattr(turns, "PATIENCE_S", 0.01)  # (the lock's waits are real)
    ranks = Turns(3)
    ranks._turn = lock = RecordingLock()
    ranks.take(2)
    clock.now = turns.STUCK_S / 2
    ranks.take(0)  # waits PATIENCE_S, the turn does not move: rank 0 runs without it
    clock.now = turns.STUCK_S
    for _ in range(5):
        ranks.take(1)
        ranks.take(0)
    assert lock.waits == [0.01, 0.01] + [None] * 10
    assert ranks._has_turn == [False, False, True]
    ranks.give_back(2)
    ranks.take(1)  # free: rank 1 takes it at once
    ranks.take(0)  # it changed hands just now: rank 0 queues for it again
    assert lock.waits[-2:] == [None, 0.01]
    assert ranks._has_turn == [False, True, False]


def test_a_rank_that_keeps_the_turn_through_a_long_call_slows_nobody():
    """Rank 2 completes a barrier, so it runs on with the turn, and then sits in one long
    C call (an Event.wait: a time.sleep the test can end early) without giving it back.
    Ranks 0 and 1 exchange 100 messages each way while it is still in that call: one
    wake-up waits PATIENCE_S for the turn, the others not at all (waiting PATIENCE_S at
    each of their ~200 wake-ups would take ~10 s, twice the call)."""
    released, finished = threading.Event(), threading.Event()
    exchanged_during_the_call = []

    def program():
        rank = dist.get_rank()
        cluster = dist.get_device()._cluster
        if rank == 2:  # arrive last at the barrier, holding the turn
            waiting = False
            while not waiting:
                time.sleep(0.001)
                with cluster.lock:
                    waiting = all(cluster.rank_state(r)[1] is not None for r in (0, 1))
            if not cluster.turns._has_turn[2]:
                cluster.turns.take(2)  # free: ranks 0 and 1 gave it back to wait
        dist.barrier()
        if rank == 2:
            holds_the_turn = cluster.turns._has_turn[2]
            try:
                released.wait(5)
            finally:
                finished.set()
            return holds_the_turn
        x, peer = np.zeros(1), 1 - rank
        for _ in range(100):
            if rank == 0:
                dist.send(x, peer)
                x = dist.recv(peer) + 1
            else:
                x = dist.recv(peer)
                dist.send(x, peer)
        if rank == 0:
            exchanged_during_the_call.append(not finished.is_set())
            released.set()
        return float(x[0])

    assert dist.launch(program, 3) == [100.0, 99.0, True]
    assert exchanged_during_the_call == [True]


def test_a_rank_whose_wait_the_holder_ends_is_woken_when_the_turn_is_given_back(monkeypatch):
    ranks = Turns(3)
    woken = []
    ranks.wake_after(1, lambda: woken.append("by a rank without the turn"))
    assert woken == ["by a rank without the turn"]  # at once
    ranks.take(0)
    ranks.wake_after(0, lambda: woken.append(1))
    ranks.wake_after(0, lambda: woken.append(2))
    assert woken == ["by a rank without the turn"]  # not while rank 0 holds the turn
    ranks.give_back(0)
    assert woken[1:] == [1]  # one at a time, in the order their waits ended
    ranks.take(1)
    ranks.give_back(1)
    assert woken[1:] == [1, 2]
    ranks.take(0)
    ranks.wake_after(0, lambda: woken.append(3))
    ranks.wake_queued()
    assert woken[1:] == [1, 2]  # the turn changed hands just now
    monkeypatch.setattr(turns.time, "monotonic", lambda: ranks._handed_over_at
                        + 2 * turns.PATIENCE_S)
    ranks.wake_queued()  # the watchdog: the holder kept the turn PATIENCE_S
    assert woken[1:] == [1, 2, 3]


def test_the_turn_is_lent_only_to_a_rank_that_wants_it_and_only_on_a_spare_core():
    ranks = Turns(2)
    ranks.take(0)
    assert not ranks.lend(0)  # lending off (no spare core measured yet)
    ranks.lending = True
    assert not ranks.lend(0)  # nobody waits for it
    ranks._taking = 1  # rank 1 waits in take()
    assert not ranks.lend(1)  # rank 1 does not hold it
    assert ranks.lend(0) and ranks._has_turn == [False, False]
    ranks.take(0)  # after its long call the lender takes it again
    assert ranks._has_turn == [True, False]


def test_a_rank_runs_while_another_computes_a_lent_gemm():
    """Rank 0 holds the turn and enters a long GEMM (`long_call`) while rank 1 waits for
    the turn: with a spare core the turn is lent and rank 1 runs during the GEMM; rank 0
    takes the turn back after it. Without one, rank 1 waits."""
    from minipar.autograd.tracking import long_call, use_device
    from minipar.distributed.cluster import Cluster

    for lending in (True, False):
        cluster = Cluster(2)
        ranks = cluster.turns
        ranks.lending = lending
        ranks.take(0)
        took = threading.Event()

        def rank_1(ranks=ranks, took=took):
            ranks.take(1)
            took.set()
            ranks.give_back(1)

        thread = threading.Thread(target=rank_1)
        thread.start()
        while not ranks._taking:  # rank 1 is in take()
            time.sleep(0.001)
        with use_device(cluster.devices[0]), long_call(1e9):  # as rank 0
            ran_during_the_call = took.wait(turns.PATIENCE_S / 2)
        thread.join()
        assert ran_during_the_call == lending
        assert ranks._has_turn[0]  # taken back after the call, or never lent
        ranks.give_back(0)


def test_a_spare_core_is_what_the_other_processes_leave(monkeypatch):
    """SpareCore counts the machine's busy time minus this process's own CPU time."""
    spare = turns.SpareCore()
    spare._cores = 2
    samples = iter([(1.0, 100.0, 10.0), (1.5, 100.5, 10.45)])  # others: 0.1 core busy
    monkeypatch.setattr(spare, "_sample", lambda: next(samples))
    spare._last = spare._sample()
    assert spare.look()  # 1.9 cores spare
    samples = iter([(2.0, 101.4, 10.5)])  # others: 1.6 cores busy over the last 0.5 s
    monkeypatch.setattr(spare, "_sample", lambda: next(samples))
    assert not spare.look()


def _run_digest(config) -> tuple[str, ...]:
    """Every figure of a run, as bytes: the report's JSON, the timelines and transfers,
    and the trained weights."""
    from minipar.train import train

    report = train(config)
    weights = b"".join(name.encode() + value.tobytes()
                       for name, value in sorted(report.state_dict.items()))
    return report.to_json(), repr(report.timelines), repr(report.transfers), weights


def test_lending_the_turn_changes_the_timing_never_a_figure(monkeypatch):
    """Whether a turn is lent depends on /proc/stat (SpareCore: what other processes do
    on the machine), so it must change when ranks run, never what they compute: a 3D
    run reports the same bytes with lending never, always, at random (as a busy machine
    would switch it), and twice at random. Every GEMM is long here, so lending happens."""
    from minipar.autograd import tracking
    from minipar.train import TrainConfig

    config = TrainConfig(steps=2, seq_len=16, n_layer=2, d_model=32, n_head=4,
                         micro_batch_size=2, grad_accum_steps=2, dp=2, tp=2, pp=2,
                         zero=1, sequence_parallel=True, precision="bf16-mixed")
    monkeypatch.setattr(tracking, "LONG_CALL_FLOPS", 0)
    lend, lent = Turns.lend, []

    def run(decide):
        def lend_as_decided(self, rank):
            self.lending = decide()  # in place of SpareCore's answer
            given = lend(self, rank)
            lent.append(given)
            return given

        monkeypatch.setattr(Turns, "lend", lend_as_decided)
        lent.clear()
        digest = _run_digest(config)
        return digest, sum(lent)

    never, lent_never = run(lambda: False)
    rng = np.random.default_rng()
    always, lent_always = run(lambda: True)
    randomly, _ = run(lambda: rng.random() < 0.5)
    again, _ = run(lambda: rng.random() < 0.5)
    assert lent_never == 0 and lent_always > 0  # the runs did differ in their timing
    assert never == always == randomly == again
