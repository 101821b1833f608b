"""GPipe and 1F1B: the same m forwards and m backwards per stage, in two orders.

Both are "flushing": every micro-batch of a step finishes before the weights change, so
the result equals single-device gradient accumulation.
- GPipe (Huang et al. 2019, Figure 2c): every forward, then every backward. Stage s holds
  the activations of all m micro-batches at once.
- 1F1B (PipeDream-Flush; Narayanan et al. 2021, section 2.2.1, Figure 3): stage s runs
  p - s - 1 warm-up forwards, then alternates one forward and one backward, then cools
  down with the backwards left. Same bubble as GPipe, but at most p - s micro-batches in
  flight: a backward frees each micro-batch's activations as early as the pipeline allows.
Bubble (section 2.2.1; uniform stages, free communication): each stage idles p - 1
forward-and-backward slots while the pipeline fills and drains, against m of work.

Each generator gives per rank its compute order, (kind, micro-batch, chunk);
`from_compute_orders` (orders.py) places the sends and receives.
"""

from __future__ import annotations

from minipar.parallel.pipeline.actions import Schedule
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.schedules.registry import ScheduleSpec, register_schedule


def gpipe(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe: all m forwards, then all m backwards (Huang et al. 2019, Figure 2c)."""
    m = micro_batches
    order = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    return from_compute_orders("gpipe", pp, m, 1, [order] * pp)


def one_f_one_b(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush: stage s runs min(p - s - 1, m) warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards (cool-down)."""
    m = micro_batches
    orders = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]
        orders.append(order)
    return from_compute_orders("1f1b", pp, m, 1, orders)


def flushing_bubble(p: int, m: int, v: int) -> float:
    """(p - 1) / (v m + p - 1): p - 1 chunk slots of fill and drain against v m of work
    (v = 1; interleaved: Narayanan et al. 2021, section 2.2.2)."""
    return (p - 1) / (v * m + p - 1)


def flushing_bubble_time(p, m, v, f, b, w):
    """(p - 1) slots of a whole forward and backward (B and W together) idle per rank."""
    return (p - 1) * (f + b + w)


FLUSHING = dict(uniform_bubble=flushing_bubble, bubble_formula="(p-1)/(m+p-1)",
                bubble_time=flushing_bubble_time)
register_schedule(ScheduleSpec(
    "gpipe", gpipe, "every forward, then every backward (Huang et al. 2019)", **FLUSHING,
    in_flight=lambda p, m, v, rank: m))
register_schedule(ScheduleSpec(
    "1f1b", one_f_one_b, "warm-up forwards, then one forward and one backward in turn "
    "(PipeDream-Flush; Narayanan et al. 2021, 2.2.1)", **FLUSHING,
    in_flight=lambda p, m, v, rank: min(p - rank, m), searched_virtual_stages=(1,)))
