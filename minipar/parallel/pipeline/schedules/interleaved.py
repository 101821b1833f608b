"""Interleaved 1F1B: each rank holds v model chunks, and the bubble shrinks by v.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", section 2.2.2, Figure 4. The layers are cut into p v chunks; chunk c
of rank r is virtual stage c p + r (the "looped" placement), so a micro-batch goes round
the ranks v times. Micro-batches go through the chunks in groups of p: p of them through
chunk 0, the same p through chunk 1, ... (hence m must be a multiple of p), and the
backwards visit the chunks in reverse. Rank r warms up with 2 (p - r - 1) + (v - 1) p
forwards (all of them when m = p), then runs 1F1B, then cools down. The order and the
warm-up follow Megatron-LM's `forward_backward_pipelining_with_interleaving`
(megatron/core/pipeline_parallel/schedules.py).

Bubble with uniform stages and free communication: each chunk is 1/v of a stage, so the
fill and drain cost (p - 1)(t_f + t_b) / v against the same m (t_f + t_b) of work:
    idle / total = (p - 1) / (v m + p - 1)      (the paper's (1/v)(p - 1)/m of ideal),
paid for with v times more point-to-point messages (p v - 1 boundaries instead of p - 1).
"""

from __future__ import annotations

from minipar.parallel.pipeline.actions import Schedule
from minipar.parallel.pipeline.schedules.one_f_one_b import (
    flushing_bubble,
    flushing_bubble_time,
)
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.schedules.registry import ScheduleSpec, register_schedule


def interleaved_1f1b(pp: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B with v model chunks per rank (Narayanan et al. 2021, Figure 4).

    The k-th forward of a rank (k = 0 .. m*v - 1) is micro-batch (k // (p*v)) * p + k % p
    on chunk (k // p) % v: p micro-batches go through chunk 0, the same p through chunk 1,
    and so on; backwards visit the chunks in reverse. Rank r runs
    2 (p - r - 1) + (v - 1) p warm-up forwards (all of them when m == p), then 1F1B, then
    cools down, as Megatron-LM does.
    """
    p, m, v = pp, micro_batches, virtual_stages
    total = m * v

    def unit(k: int, forward: bool) -> tuple[str, int, int]:
        group, index = divmod(k, p * v)
        chunk = index // p
        return ("F" if forward else "B", group * p + index % p,
                chunk if forward else v - 1 - chunk)

    orders = []
    for rank in range(p):
        if m == p:
            warmup = total
        else:
            warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        order = [unit(k, True) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(warmup + k, True), unit(k, False)]
        order += [unit(k, False) for k in range(total - warmup, total)]
        orders.append(order)
    return from_compute_orders("interleaved", p, m, v, orders)


def _interleaved_in_flight(p: int, m: int, v: int, rank: int) -> int:
    """Megatron-LM's warm-up plus the steady state's one (all v m when m = p);
    Korthikanti et al. 2022, 4.2.3: rank 0 holds 1 + (p-1)/(p v) of one model's."""
    total = m * v
    return total if m == p else min(2 * (p - rank - 1) + (v - 1) * p + 1, total)


register_schedule(ScheduleSpec(
    "interleaved", interleaved_1f1b, "1F1B over v model chunks per rank, micro-batches in "
    "groups of p (Narayanan et al. 2021, 2.2.2)",
    uniform_bubble=flushing_bubble, bubble_formula="(p-1)/(v·m+p-1)",
    # (p-1) chunk slots: the paper's (p-1)(t_f+t_b)/v with per-stage times v (f+b+w)
    bubble_time=flushing_bubble_time,
    in_flight=_interleaved_in_flight,
    # the last chunk runs each micro-batch's backward right after its forward, unless
    # every forward runs first (m = p)
    last_stage_in_flight=lambda p, m, v: m if m == p else 1,
    virtual_stages=(2, None), min_pp=2, micro_batches_multiple_of_pp=True,
    searched_virtual_stages=(2,)))
