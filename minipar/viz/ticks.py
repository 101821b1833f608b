"""How many rank labels an axis has room for.

    every = label_every(n_ranks, most=16)            # label ranks 0, every, 2 * every ...
"""

from __future__ import annotations


def label_every(count: int, most: int) -> int:
    """Label every k-th of `count` ranks along an axis with room for `most` labels: 1 up to
    `most` (every rank), else the least power of two that brings them under `most` (32
    ranks in room for 12: every 4th; powers of two fall on the node boundaries of the
    usual layouts). tests/viz/test_legibility.py checks that the labels stay apart."""
    every, most = 1, max(1, most)  # (an axis with room for none still gets one)
    while count > most * every:
        every *= 2
    return every
