"""A pipeline rank's activation peak, walked over the order its schedule computes in.

memory.py's closed form holds the schedule's k micro-batches in flight (its `in_flight`)
as k/v of each of the rank's v chunks, the head's and the embedding's by their own
counts, and one chunk's recomputation working set on top: exact when the chunks save
alike. When they do not (chunks that hold their MoE layers differently: an MoE layer
saves several times a dense one), which chunks' micro-batches are held at the peak, and
which chunk's backward runs then, decide it. This walks the rank's compute order (the
schedule's generator, the one the trainer runs):

    F of chunk c   adds what one micro-batch of c holds until its backward (`held[c]`:
                   its layers' saved bytes, the embedding's ids on virtual stage 0, the
                   head's on the last; under full recomputation not its input, which
                   arrived as a buffer or was handed over by the chunk before it)
    B (or I)       while it runs, c's working set on top (`working[c]`: a checkpointed
                   segment recomputing, or one attention core's probabilities); a B
                   then frees held[c]
    W              frees held[c] (a split backward's micro-batch counts until its W,
                   as the schedules' in_flight counts it)

and returns the largest sum. Exact against the emulator for the interleaved schedule
and DualPipe-V (tests/plan/test_experts.py). What a split backward keeps between an I
and its W is what the I leaves (the saved inputs of the layers W calls again and their
output gradients, autograd/engine.py), not held[c]: where ZB-V's peak falls there it
reads low (of the toy MoE layouts measured: within 0.2% without recomputation, 1.6%
with selective, up to 8% low with full and 18% with full's block method).

How far: a schedule's held micro-batches repeat once its pipeline is full, so the peak
of m micro-batches is that of min(m, 2p) (the smallest count >= 2p the schedule
accepts): tests/plan/test_walked_activations.py checks it against whole walks up to 6p
for every registered schedule with several chunks, so a plan of 65,536 micro-batches
walks 2p.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from minipar.parallel.pipeline.actions import Backward, Forward
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, make_schedule
from minipar.parallel.pipeline.split_backward import BackwardInput, BackwardWeight

_KINDS = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}


# Actions a walk generates at most (pp ranks x walked micro-batches x chunks x F/B/W):
# 64 ranks of 4 chunks take a tenth of a second to generate, once per (schedule, pp, m, v);
# beyond it (pipelines of hundreds of ranks, searched) memory.py keeps its closed form.
WALK_LIMIT = 2**15


def walkable(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> bool:
    """Whether a rank of this pipeline is walked (WALK_LIMIT)."""
    return pp * walked_micro_batches(schedule, pp, micro_batches) * virtual_stages <= WALK_LIMIT


def walked_micro_batches(schedule: str, pp: int, micro_batches: int) -> int:
    """Micro-batches walked for a step of `micro_batches`: all of them, or 2p once the
    pipeline is full (rounded up to what the schedule accepts)."""
    spec = SCHEDULES[schedule]
    full = max(2 * pp, spec.min_micro_batches(pp))
    if spec.micro_batches_multiple_of_pp:
        full = -(-full // pp) * pp
    return min(micro_batches, full)


@lru_cache(maxsize=64)  # every rank of a plan, and every layout of a search with them
def compute_orders(schedule: str, pp: int, micro_batches: int, virtual_stages: int
                   ) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per rank, its computations in order: (kind F/B/I/W, chunk)."""
    plan = make_schedule(schedule, pp, micro_batches, virtual_stages, validated=False)
    return tuple(tuple((_KINDS[type(a)], a.chunk) for a in actions if type(a) in _KINDS)
                 for actions in plan.actions)


def peak_of(order: Sequence[tuple[str, int]], held: Sequence[int],
            working: Sequence[int]) -> int:
    """The largest bytes held along `order` (module docstring)."""
    now = peak = 0
    for kind, c in order:
        if kind == "F":
            now += held[c]
            peak = max(peak, now)
        elif kind == "W":
            now -= held[c]
        else:  # B or I
            peak = max(peak, now + working[c])
            if kind == "B":
                now -= held[c]
    return peak


def walked_peak(schedule: str, pp: int, micro_batches: int, rank: int,
                held: Sequence[int], working: Sequence[int]) -> int:
    """Peak activation bytes of pipeline rank `rank` whose chunk c holds held[c] per
    micro-batch in flight and adds working[c] while its backward runs."""
    m = walked_micro_batches(schedule, pp, micro_batches)
    return peak_of(compute_orders(schedule, pp, m, len(held))[rank], held, working)
