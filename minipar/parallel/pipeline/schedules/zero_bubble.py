"""Zero-bubble schedules: the backward split in B and W, the W's moved into the bubbles.

Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024). A stage's backward
is two halves: B (printed I: the gradient of the stage's input, which the previous stage
waits for) and W (the weight gradients, which nobody waits for). Only the B's make the
critical path; the W's can run later, in the time 1F1B leaves idle.
- ZB-H1 (section 3.1, Figure 3 top): 1F1B with each W delayed; 1F1B's memory.
- ZB-H2 (section 3.1, Figure 3 bottom): more warm-up forwards, W delayed further: a
  parallelogram with no bubble inside the step, for 2p - 1 micro-batches in flight.
- ZB-V (section 6, Figure 8): two chunks per rank in a V, 1F1B's memory.
Table 2's bubble per stage, with T_F, T_B, T_W the times of one micro-batch's F, B and W:
    1F1B (p-1)(T_F+T_B+T_W),  ZB-H1 (p-1)(T_F+T_B-T_W),  ZB-H2 (p-1)(T_F+T_B-2T_W).
The actions I and W, and how a rank runs them: ../split_backward.py. The settings a
generator gets are checked by the registry (make_schedule) against its ScheduleSpec.
"""

from __future__ import annotations

from minipar.parallel.pipeline.actions import Schedule
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.schedules.registry import ScheduleSpec, register_schedule


# --------------------------------------------------------------------------- ZB-H1, ZB-H2
def _delayed_w(name: str, pp: int, m: int, warmup, delay) -> Schedule:
    """1F1B with B split in I and W: rank r runs warmup(r) forwards, then F, I in turn,
    each I followed by the W of the micro-batch `delay(r)` I's back (its oldest queued
    W, as the ZB authors' WeightGradStore pops them), the rest of the W's at the end."""
    orders = []
    for rank in range(pp):
        w = min(warmup(rank), m)
        order = [("F", i, 0) for i in range(w)]
        queued = []
        for i in range(m):
            if w + i < m:
                order.append(("F", w + i, 0))
            order.append(("I", i, 0))
            queued.append(i)
            if i >= delay(rank):
                order.append(("W", queued.pop(0), 0))
        order += [("W", i, 0) for i in queued]
        orders.append(order)
    return from_compute_orders(name, pp, m, 1, orders)


def zb_h1(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024, section 3.1, Figure 3 top): 1F1B's p-r-1 warm-up forwards,
    and rank r delays its W's by r micro-batches, so every rank holds at most p
    micro-batches between F and W (1F1B's peak, rank 0's) and the W's of the later ranks
    fill the cool-down, the I's alone making the critical path. The order of the ZB
    authors' ZB-H1 patch to Megatron's 1F1B (README, "zb-h1-quick-start")."""
    return _delayed_w("zb-h1", pp, micro_batches, lambda r: pp - r - 1, lambda r: r)


def zb_h2(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H2 (Qi et al. 2024, section 3.1, Figure 3 bottom): 2(p-r-1) warm-up forwards
    fill the wait for the first gradient and rank r delays its W's by 2r, so every rank
    holds 2p-1 micro-batches between F and W and the step is a parallelogram: no bubble
    inside it when T_F + T_B <= 2 T_W. What is left is the skew: rank r starts r T_F
    late and ends r T_F late, and the optimizer step waits for the last rank (the
    gradient-norm all-reduce), so (p-1) T_F per step stays idle; the paper's
    post-validation lets the next step start before that sync to remove it."""
    return _delayed_w("zb-h2", pp, micro_batches, lambda r: 2 * (pp - r - 1),
                      lambda r: 2 * r)


def _zero_bubble_share(bubble_time):
    """The idle share of the step at T_F = T_B = T_W (one chunk of work costs 3 units)."""
    def share(p, m, v):
        idle = bubble_time(p, m, v, 1.0, 1.0, 1.0)
        return idle / (idle + 3 * m * v)
    return share


def _zb_h1_bubble(p, m, v, f, b, w):
    return (p - 1) * (f + b - w)


def _zb_h2_bubble(p, m, v, f, b, w):
    # Table 2's (p-1)(T_F+T_B-2T_W), but never below the skew a synchronised step keeps
    return (p - 1) * max(f, f + b - 2 * w)


register_schedule(ScheduleSpec(
    "zb-h1", zb_h1, "1F1B with the backward split in B and W, W delayed into the "
    "cool-down (Qi et al. 2024, ZB-H1)",
    uniform_bubble=_zero_bubble_share(_zb_h1_bubble), bubble_formula="(p-1)/(3m+p-1)",
    bubble_time=_zb_h1_bubble, in_flight=lambda p, m, v, rank: p,
    min_micro_batches=lambda p: p, split_backward=True))

register_schedule(ScheduleSpec(
    "zb-h2", zb_h2, "more warm-up forwards and W delayed further: a parallelogram, "
    "no bubble inside the step (Qi et al. 2024, ZB-H2)",
    uniform_bubble=_zero_bubble_share(_zb_h2_bubble), bubble_formula="(p-1)/(3m+p-1)",
    bubble_time=_zb_h2_bubble, in_flight=lambda p, m, v, rank: 2 * p - 1,
    min_micro_batches=lambda p: 2 * p - 1, split_backward=True))


# --------------------------------------------------------------------------- ZB-V
def zb_v(pp: int, micro_batches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6, Figure 8): two chunks per rank in a V (chunk 1 of
    rank r is virtual stage 2p-1-r, so rank 0 holds the first and the last stage), the
    backward split in I and W, 1F1B's peak activation memory. The order is PyTorch's
    `ScheduleZBVZeroBubble._calculate_single_rank_operations`
    (torch/distributed/pipelining/schedules.py): 2(p-r)-1 forwards of chunk 0, then r
    pairs F chunk 1 / F chunk 0, then p-r triples F I W on chunk 1, a steady state of
    F I W on chunk 0 then chunk 1, and a cool-down of I's whose W's come last."""
    return from_compute_orders("zb-v", pp, micro_batches, 2,
                               [_zb_v_rank(pp, micro_batches, r) for r in range(pp)],
                               placement="v")


def _zb_v_rank(p: int, m: int, rank: int) -> list:
    """One rank's compute order of ZB-V (see zb_v)."""
    order = []
    count = {"F0": 0, "F1": 0, "I0": 0, "I1": 0, "W0": 0, "W1": 0}

    def run(kind: str, chunk: int) -> None:
        name = f"{kind}{chunk}"
        if count[name] < m:  # PyTorch drops the actions of micro-batches >= m
            order.append((kind, count[name], chunk))
        count[name] += 1

    for _ in range(2 * (p - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1)
        run("F", 0)
    for _ in range(p - rank):
        run("F", 1)
        run("I", 1)
        run("W", 1)
    while count["F1"] < count["F0"] or count["F0"] < m:
        if count["F0"] < m:
            run("F", 0)
        run("I", 0)
        run("W", 0)
        run("F", 1)
        run("I", 1)
        run("W", 1)
    for _ in range(rank):
        run("I", 0)
        run("I", 1)
    for _ in range(p - rank):
        run("I", 0)
        run("W", 0)
    while count["W1"] < count["I1"]:
        run("W", 1)
    while count["W0"] < count["I0"]:
        run("W", 0)
    return order


def v_shape_bubble(p: int, m: int, v: int) -> float:
    """Measured, not a paper's formula: at T_F = T_B = T_W both V schedules (ZB-V and
    DualPipe-V) leave (p-1) chunk slots idle per rank (the skew of a synchronised step)
    against 2 x 3m of work. (DualPipe's README gives (2p/2-1)(F&B+B-3W) = 2(p-1) slots
    for DualPipe-V with F&B = F + B; the ZB paper's ZB-V figure has none inside the
    step.)"""
    return (p - 1) / (6 * m + p - 1)


register_schedule(ScheduleSpec(
    "zb-v", zb_v, "two chunks per rank in a V, backward split in B and W (Qi et al. "
    "2024, ZB-V)",
    uniform_bubble=v_shape_bubble, bubble_formula="(p-1)/(6m+p-1)",
    # 2p chunk-halves of a stage: 1F1B's p micro-batches of one stage's activations
    in_flight=lambda p, m, v, rank: 2 * p, last_stage_in_flight=lambda p, m, v: 1,
    virtual_stages=(2, 2), placement="v", min_pp=2, min_micro_batches=lambda p: 2 * p - 1,
    split_backward=True))
