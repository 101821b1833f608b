"""The cyclic garbage collector while ranks run (minipar/distributed/collector.py)."""

import gc
import threading

import pytest

from minipar import distributed as dist
from minipar.distributed.collector import GEN0_THRESHOLD, fewer_collections
from minipar.train import train


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield saved
    gc.set_threshold(*saved)


def test_a_launch_raises_the_first_threshold_while_its_ranks_run(thresholds):
    gc.set_threshold(700, 10, 10)
    seen = dist.launch(lambda: gc.get_threshold(), 2)
    assert seen == [(GEN0_THRESHOLD, 10, 10)] * 2
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("first", [0, GEN0_THRESHOLD * 2])
def test_a_process_that_collects_less_often_or_never_is_left_alone(thresholds, first):
    gc.set_threshold(first, 10, 10)
    assert dist.launch(lambda: gc.get_threshold()[0], 2) == [first] * 2
    assert gc.get_threshold() == (first, 10, 10)


def test_overlapping_launches_put_the_threshold_back_when_the_last_returns(thresholds):
    gc.set_threshold(700, 10, 10)
    inside, release = threading.Event(), threading.Event()

    def long_launch():
        with fewer_collections():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=long_launch)
    other.start()
    assert inside.wait(10)
    dist.launch(lambda: None, 2)  # starts and returns while the other one runs
    assert gc.get_threshold()[0] == GEN0_THRESHOLD
    release.set()
    other.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def test_the_autograd_graph_of_a_run_holds_no_reference_cycles():
    # What the ledgers book may not depend on when the collector runs: every graph node
    # (Context) and Tensor of a training run is freed by its last reference, none is left
    # to the collector. (The run's devices and models do form cycles, freed as a whole.)
    class Cycle:
        pass

    gc.collect()
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        train(d_model=32, n_head=2, n_layer=2, seq_len=16, micro_batch_size=2,
              grad_accum_steps=2, dp=2, tp=2, pp=2, steps=2)
        cycle = Cycle()
        cycle.itself = cycle
        del cycle
        gc.collect()
        kinds = {type(o).__name__ for o in gc.garbage}
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
    assert "Context" not in kinds and "Tensor" not in kinds
    assert "Cycle" in kinds  # (the test sees the cycles there are)
