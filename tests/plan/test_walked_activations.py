"""The walk of a pipeline rank's compute order (plan/walked_activations.py): what it
holds when, and that walking 2p micro-batches finds the peak of any longer step (the
emulator-backed checks are in test_experts.py)."""

from __future__ import annotations

import random

import pytest

from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.plan.walked_activations import (
    compute_orders,
    peak_of,
    splits_backward,
    walked_micro_batches,
    walked_peak,
)


def test_a_later_chunks_working_set_can_set_the_peak():
    """Interleaved, m = p = 2: every forward first, then the backwards of chunk 1 (the
    head's) and of chunk 0. Chunk 0 recomputes a larger segment than chunk 1 saves: its
    backward, after chunk 1's micro-batches are freed, is the peak, not the head's."""
    order = compute_orders("interleaved", 2, 2, 2)[1]
    assert order == (("F", 0), ("F", 0), ("F", 1), ("F", 1),
                     ("B", 1), ("B", 1), ("B", 0), ("B", 0))
    held, working = (10, 3), (40, 1)
    assert peak_of(order, held, working) == 2 * 10 + 40
    assert peak_of(order, (10, 3), (0, 1)) == 2 * 10 + 2 * 3 + 1  # the head's, then


def test_a_split_backward_holds_its_micro_batch_until_w():
    order = [("F", 0), ("I", 0), ("F", 0), ("W", 0), ("I", 0), ("W", 0)]
    assert peak_of(order, (5,), (2,)) == 2 * 5


def test_between_i_and_w_a_micro_batch_holds_what_its_i_kept():
    """F adds held (10); I adds its working set on top (4), then leaves kept (3) in
    place of held; W frees kept. Here the second I runs before the first W."""
    order = [("F", 0), ("I", 0), ("F", 0), ("I", 0), ("W", 0), ("W", 0)]
    assert peak_of(order, (10,), (0,), kept=(3,), input_working=(4,)) == 3 + 10 + 4
    assert peak_of(order, (10,), (0,), kept=(3,), input_working=(0,)) == 3 + 10
    # a W that keeps more than the forward saved (sequence parallelism's all-gathered
    # output gradients): the second micro-batch's I is the peak
    assert peak_of(order, (10,), (0,), kept=(12,), input_working=(2,)) == 12 + 10 + 2


def walked_schedules():
    """(schedule, chunks) of every walked rank: several chunks, or a split backward."""
    for name, spec in SCHEDULES.items():
        fewest, most = spec.virtual_stages
        for v in range(fewest, (most or 3) + 1):
            if v > 1 or splits_backward(name, 2, spec.min_micro_batches(2), v):
                yield name, v


@pytest.mark.parametrize("name, v", list(walked_schedules()))
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_two_p_micro_batches_find_the_peak_of_any_step(name, v, p):
    spec = SCHEDULES[name]
    step = p if spec.micro_batches_multiple_of_pp else 1
    fewest = -(-spec.min_micro_batches(p) // step) * step
    rng = random.Random(p * 10 + v)
    for m in range(fewest, 6 * p + 1, step):
        assert walked_micro_batches(name, p, m) == min(m, max(2 * p, fewest))
        for _ in range(3):
            held = [rng.randint(1, 100) for _ in range(v)]
            working = [rng.randint(0, 150) for _ in range(v)]
            kept = [rng.randint(0, 150) for _ in range(v)]
            input_working = [rng.randint(0, 150) for _ in range(v)]
            for rank, order in enumerate(compute_orders(name, p, m, v)):
                assert walked_peak(name, p, m, rank, held, working) == peak_of(
                    order, held, working), (m, rank)
                assert walked_peak(name, p, m, rank, held, working, kept,
                                   input_working) == peak_of(
                    order, held, working, kept, input_working), (m, rank)
