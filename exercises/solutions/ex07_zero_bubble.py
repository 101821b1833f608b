"""Reference solution of exercise 07 (for teachers; the student file is
exercises/ex07_zero_bubble.py)."""

from __future__ import annotations

import numpy as np


def linear_backward_input(grad_out: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return grad_out @ weight.T


def linear_backward_weight(x: np.ndarray, grad_out: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    x2 = x.reshape(-1, x.shape[-1])
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    return x2.T @ g2, g2.sum(axis=0)


def zb_h1_compute_order(pp: int, micro_batches: int, rank: int) -> list[tuple[str, int]]:
    m = micro_batches
    warmup = min(pp - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    queued = []
    for i in range(m):
        if warmup + i < m:
            order.append(("F", warmup + i))
        order.append(("I", i))
        queued.append(i)
        if i >= rank:  # stage r delays its W's by r micro-batches
            order.append(("W", queued.pop(0)))
    order += [("W", i) for i in queued]
    return order
