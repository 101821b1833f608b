"""Reference solution of exercise 08: ZeRO-3's gather and free, with prefetch."""

from __future__ import annotations


def zero3_actions(n_units: int, prefetch: bool) -> list[tuple[str, int]]:
    forward = list(range(n_units))
    backward = forward[::-1]
    actions = []
    for order, kind in ((forward, "forward"), (backward, "backward")):
        actions.append(("gather", order[0]))
        for i, unit in enumerate(order):
            actions.append(("wait", unit))
            if prefetch and i + 1 < len(order):
                actions.append(("gather", order[i + 1]))  # runs while this unit computes
            actions.append((kind, unit))
            actions.append(("free", unit))
            if not prefetch and i + 1 < len(order):
                actions.append(("gather", order[i + 1]))
    return actions
