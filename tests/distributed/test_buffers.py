"""Buffer lifetimes booked by minipar.distributed, so strategies do not call the ledger:
`transient` scopes an array's life, `hold` / `release` open and close one, and the
collectives and `recv` book the arrays they return when given `category=`."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist


def ledger():
    return dist.get_device().memory


def test_a_transient_buffer_lives_exactly_inside_its_block():
    def rank():
        before = dict(ledger().current)
        with dist.transient(np.zeros(100)) as buffer:  # 800 bytes
            inside = ledger().current["buffers"]
            assert ledger().is_held(buffer)
        after = ledger().current["buffers"]
        return before["buffers"], inside, after, ledger().peak["buffers"]

    assert dist.launch(rank, 1) == [(0, 800, 0, 800)]


def test_a_transient_buffer_is_released_when_its_block_raises():
    def rank():
        with pytest.raises(KeyError), dist.transient(np.zeros(10), "grads"):
            raise KeyError("inside")
        return ledger().current["grads"], ledger().peak["grads"]

    assert dist.launch(rank, 1) == [(0, 80)]


def test_hold_returns_the_array_and_release_drops_it():
    def rank():
        shard = dist.hold(np.zeros(4, np.float32), "optimizer")
        held = ledger().current["optimizer"]
        dist.release(shard)
        return held, ledger().current["optimizer"]

    assert dist.launch(rank, 1) == [(16, 0)]


@pytest.mark.parametrize("api", ["all_reduce", "all_gather", "reduce_scatter"])
def test_a_collective_books_its_result_under_the_category_it_is_given(api):
    x = np.arange(8.0)  # 64 bytes in; all_gather returns 2x, reduce_scatter 1/2

    def rank():
        result = getattr(dist, api)(x, group=None, category="buffers")
        booked = ledger().current["buffers"]
        plain = getattr(dist, api)(x)  # no category: the caller books it (or not)
        return result.nbytes, booked, ledger().current["buffers"], ledger().is_held(plain)

    for nbytes, booked, after, plain_held in dist.launch(rank, 2):
        assert nbytes == {"all_reduce": 64, "all_gather": 128, "reduce_scatter": 32}[api]
        assert booked == after == nbytes
        assert not plain_held


@pytest.mark.parametrize("world", [1, 2])
def test_an_async_result_is_booked_when_the_rank_gets_it_and_only_once(world):
    def rank():
        work = dist.reduce_scatter(np.ones(4), op="avg", async_op=True, category="buffers")
        posted = ledger().current["buffers"]
        piece = work.wait()
        work.wait()  # waiting again returns the same array and books nothing more
        booked = ledger().current["buffers"]
        dist.release(piece)
        return posted, booked, piece.nbytes, ledger().current["buffers"]

    for posted, booked, nbytes, after in dist.launch(rank, world):
        assert (posted, booked, after) == (0, nbytes, 0)


def test_a_received_array_is_booked_under_its_category():
    def rank():
        me = dist.get_rank()
        if me == 0:
            dist.send(np.zeros(6), 1)
            return None
        data = dist.recv(0, category="buffers")
        return data.nbytes, ledger().current["buffers"]

    assert dist.launch(rank, 2)[1] == (48, 48)


def test_an_unknown_category_is_refused_when_the_call_is_made():
    def rank():
        dist.all_reduce(np.ones(2), async_op=True, category="scratch")

    with pytest.raises(ValueError, match="'scratch' is not one of"):
        dist.launch(rank, 1)
