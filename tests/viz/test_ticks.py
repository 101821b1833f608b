"""How many rank labels an axis gets."""

from __future__ import annotations

from minipar.viz.ticks import label_every


def test_label_every_labels_all_ranks_that_fit_and_powers_of_two_past_them():
    assert [label_every(n, 8) for n in (1, 8, 9, 16, 17, 64, 128)] == [1, 1, 2, 2, 4, 8, 16]
    assert label_every(32, 12) == 4  # 32 / 4 = 8 labels: within room for 12
    assert label_every(16, 0) == 16  # an axis with room for none: one label, no hang
