"""Placements: which virtual stage chunk c of pipeline rank r runs, when a rank holds
several chunks (v > 1; with one chunk per rank, rank r runs stage r).

    looped   Megatron-LM's interleaving (Narayanan et al. 2021, section 2.2.2): stage
             c p + r, the chunks go round the ranks.
    v        Qi et al. 2024's ZB-V and DeepSeek's DualPipe-V: even chunks go down the
             ranks, odd ones come back up, so chunk 1 of rank r is stage 2p - 1 - r and
             rank 0 holds the first and the last stage.

A schedule names its placement (`Schedule.placement`, actions.py).
"""

from __future__ import annotations


def looped(pp: int, rank: int, chunk: int) -> int:
    """Megatron-LM's interleaving: chunk c of rank r is virtual stage c p + r."""
    return chunk * pp + rank


def v_shape(pp: int, rank: int, chunk: int) -> int:
    """ZB-V / DualPipe-V: even chunks run down the ranks, odd chunks back up."""
    return chunk * pp + (rank if chunk % 2 == 0 else pp - 1 - rank)


PLACEMENTS = {"looped": looped, "v": v_shape}
