"""DualPipe-V: ZB-V's V, with the forward of one micro-batch beside the backward of another.

DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.2.1: DualPipe feeds
micro-batches from both ends of the pipeline and overlaps the forward of one with the
backward of another, so that each hides the other's communication (the MoE all-to-all).
DualPipe-V is its "cut-in-half" form (Sea AI Lab's blog; DeepSeek's dualpipe/dualpipev.py):
one set of ranks, two chunks each in ZB-V's V (chunk 0 down the ranks, chunk 1 back up,
the loss on rank 0), the backward split in B and W where a W can fill a wait.

minipar has no communication inside a chunk to hide, so the overlapped pair is an F
followed by a B on one compute stream: on the simulated clock F&B costs F + B. The
settings a generator gets are checked by the registry (make_schedule) against the rules
its ScheduleSpec declares.
"""

from __future__ import annotations

from minipar.parallel.pipeline.actions import Schedule
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.schedules.registry import ScheduleSpec, register_schedule
from minipar.parallel.pipeline.schedules.zero_bubble import v_shape_bubble


def dualpipe_v(pp: int, micro_batches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipe-V (DeepSeek-V3 report section 3.2.1; the "cut-in-half" V of Sea AI Lab's
    blog): DeepSeek's `DualPipeV.step` (dualpipe/dualpipev.py, steps 1-8) replayed with
    counters per chunk ("phase") and a first-in first-out queue of W's, as its
    WeightGradStore pops them. Chunk 0 runs down the ranks, chunk 1 back up (the loss on
    rank 0). `_forward_backward_chunk(a, b)`, the forward of chunk a's next micro-batch
    overlapped with the full backward of chunk b's, is an F followed by a B here."""
    return from_compute_orders("dualpipe-v", pp, micro_batches, 2,
                               [_dualpipe_v_rank(pp, micro_batches, r) for r in range(pp)],
                               placement="v")


def _dualpipe_v_rank(p: int, m: int, rank: int) -> list:
    """One rank's compute order of DualPipe-V (see dualpipe_v)."""
    order = []
    forwards, backwards, queued = [0, 0], [0, 0], []

    def forward(chunk: int) -> None:
        order.append(("F", forwards[chunk], chunk))
        forwards[chunk] += 1

    def backward(chunk: int, zero_bubble: bool = False) -> None:
        i = backwards[chunk]
        backwards[chunk] += 1
        order.append(("I" if zero_bubble else "B", i, chunk))
        if zero_bubble:
            queued.append((i, chunk))

    def weight() -> None:
        i, chunk = queued.pop(0)
        order.append(("W", i, chunk))

    for _ in range(2 * (p - rank - 1)):  # step 1: nF0
        forward(0)
    for _ in range(rank + 1):  # step 2: nF0F1
        forward(0)
        forward(1)
    for _ in range(p - rank - 1):  # step 3: nB1W1F1 (zero bubble)
        backward(1, zero_bubble=True)
        weight()
        forward(1)
    for _ in range(m - 2 * p + rank + 1):  # step 4: nF0B1F1B0, F&B pairs
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - rank - 1):  # step 5: nB1F1B0
        backward(1)
        forward(1)
        backward(0)
    half, zero_bubble = (rank + 1) // 2, False  # step 6: nB1B0, second half split
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            zero_bubble = True
        backward(1, zero_bubble)
        if i == half and rank % 2 == 0:
            zero_bubble = True
        backward(0, zero_bubble)
    for _ in range(p - rank - 1):  # step 7: nWB0
        weight()
        backward(0, zero_bubble=True)
    while queued:  # step 8: nW
        weight()
    return order


register_schedule(ScheduleSpec(
    "dualpipe-v", dualpipe_v, "DeepSeek's V-shaped DualPipe: forward of one micro-batch "
    "with the backward of another (DeepSeek-V3, DualPipeV)",
    uniform_bubble=v_shape_bubble, bubble_formula="(p-1)/(6m+p-1)",
    # DualPipe's README: PP + 1 chunks of activations (PP = 2p stages)
    in_flight=lambda p, m, v, rank: 2 * p + 1, last_stage_in_flight=lambda p, m, v: 1,
    virtual_stages=(2, 2), placement="v", min_pp=2, min_micro_batches=lambda p: 2 * p,
    split_backward=True))
