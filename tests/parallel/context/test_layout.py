"""How context parallelism cuts the sequence (layout.py): the load-balanced chunks,
equal work per rank, and the layouts refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.parallel.context.layout import chunk_ids, positions
from minipar.parallel.context.ring_attention import attending_pairs

CHECK = dict(steps=2, precision="fp64", check=True, seq_len=16, n_layer=2, d_model=32,
             n_head=4, micro_batch_size=2, data="synthetic", vocab_size=32)


def test_load_balanced_layout_gives_rank_r_chunks_r_and_2n_minus_1_minus_r():
    assert chunk_ids(0, 4, True) == (0, 7) and chunk_ids(3, 4, True) == (3, 4)
    assert positions(16, 1, 2, True).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert positions(16, 0, 2, True).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 1, 2, False).tolist() == list(range(8, 16))
    every = np.sort(np.concatenate([positions(24, r, 3, True) for r in range(3)]))
    assert every.tolist() == list(range(24))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_load_balancing_gives_every_rank_the_same_chunk_pairs(n):
    pairs = [[len(attending_pairs(chunk_ids(r, n, True), chunk_ids(o, n, True)))
              for o in range(n)] for r in range(n)]
    assert len({sum(p) for p in pairs}) == 1  # every rank 2N-1 full + 2 diagonal pairs
    assert sum(pairs[0]) == 2 * n + 1
    unbalanced = [sum(len(attending_pairs(chunk_ids(r, n, False), chunk_ids(o, n, False)))
                      for o in range(n)) for r in range(n)]
    assert unbalanced == list(range(1, n + 1))  # rank r attends to r + 1 blocks


@pytest.mark.parametrize("settings, message", [
    (dict(cp=3), "does not split into 2 x cp = 6 chunks"),
    (dict(cp=3, cp_load_balance=False), "does not split into cp = 3 pieces"),
    (dict(cp=2, tp=4, sequence_parallel=True, seq_len=12), "do not split over --tp 4"),
    (dict(cp=2, dropout=0.1, check=False), "attention dropout"),
    (dict(cp=2, recompute_granularity="selective"), "nothing to recompute"),
])
def test_layouts_that_cannot_cut_the_sequence_are_refused_with_the_reason(settings, message):
    from minipar.train.config import TrainConfig
    from minipar.train.layouts import check_layout

    config = TrainConfig(**{**CHECK, "vocab_size": 32, **settings})
    with pytest.raises(ValueError, match=message) as err:
        check_layout(config)
    assert str(err.value).startswith("--") and "--cp" in str(err.value)
