"""A pipeline rank's activation peak, walked over the order its schedule computes in
(and, by the same walk, the peak of its pipeline messages: walked_messages).

memory.py's closed form holds the schedule's k micro-batches in flight (its `in_flight`)
as k/v of each of the rank's v chunks, the head's and the embedding's by their own
counts, and one chunk's recomputation working set on top: exact when the chunks save
alike. When they do not (chunks that hold their MoE layers differently: an MoE layer
saves several times a dense one), which chunks' micro-batches are held at the peak, and
which chunk's backward runs then, decide it; so does, under a split backward (the
zero-bubble schedules), what a micro-batch holds between its I and its W. This walks
the rank's compute order (the schedule's generator, the one the trainer runs):

    F of chunk c   adds what one micro-batch of c holds until its backward (`held[c]`:
                   its layers' saved bytes, the embedding's ids on virtual stage 0, the
                   head's on the last; under full recomputation not its input, which
                   arrived as a buffer or was handed over by the chunk before it)
    B              while it runs, c's working set on top (`working[c]`: a checkpointed
                   segment recomputing, or one attention core's probabilities); then
                   frees held[c]
    I              a split backward's first half: while it runs, its own working set
                   on top (`input_working[c]`), then it frees held[c] but leaves
                   `kept[c]`, what its W will need (the linear layers' saved inputs and
                   output gradients, the norms' weight gradients; nothing of a
                   checkpointed layer, whose I makes its weight gradients itself)
    W              frees kept[c]

and returns the largest sum. kept and input_working are plan/split_backward.py's,
which replays an I op by op as the emulator's ledger sees it (autograd/engine.py's
WeightGradient). Exact against the emulator for the interleaved schedule and
DualPipe-V (tests/plan/test_experts.py), and for ZB-H1, ZB-H2 and ZB-V on every layout
tests/plan/test_walked_activations.py trains (no, selective, full and full block
recomputation, pp 2-3, 4-9 micro-batches, TP with and without SP, CP, MoE with EP,
bf16); split_backward.py names what it does not replay. Holding held[c]
until the W instead reads the zero-bubble schedules' peaks up to 24.5% off in either
direction (benchmarks/fuzz_layouts.py --plan: high where a W keeps less than the
forward saved, low where the I's own working set or sequence parallelism's
all-gathered output gradients, kept for W, set the peak).

How far: a schedule's held micro-batches repeat once its pipeline is full, so the peak
of m micro-batches is that of min(m, 2p) (the smallest count >= 2p the schedule
accepts): tests/plan/test_walked_activations.py checks it against whole walks up to 6p
for every registered schedule that is walked (several chunks, or a split backward), so
a plan of 65,536 micro-batches walks 2p. Beyond WALK_LIMIT memory.py keeps its closed
form, or for a split backward an upper bound (memory.py `_activations`).
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
            working: Sequence[int], kept: Sequence[int] | None = None,
            input_working: Sequence[int] | None = None) -> int:
    """The largest bytes held along `order` (module docstring). Without `kept` a split
    backward's I keeps held[c] and adds working[c] while it runs."""
    kept = held if kept is None else kept
    input_working = working if input_working is None else input_working
    now = peak = 0
    for kind, c in order:
        if kind == "F":
            now += held[c]
            peak = max(peak, now)
        elif kind == "B":
            peak = max(peak, now + working[c])
            now -= held[c]
        elif kind == "I":
            peak = max(peak, now + input_working[c])
            now += kept[c] - held[c]
        else:  # W
            now -= kept[c]
    return peak


def walked_peak(schedule: str, pp: int, micro_batches: int, rank: int,
                held: Sequence[int], working: Sequence[int],
                kept: Sequence[int] | None = None,
                input_working: Sequence[int] | None = None) -> int:
    """Peak activation bytes of pipeline rank `rank` whose chunk c holds held[c] per
    micro-batch in flight and adds working[c] while its backward runs; a split
    backward's I adds input_working[c] while it runs and leaves kept[c] until the W."""
    m = walked_micro_batches(schedule, pp, micro_batches)
    return peak_of(compute_orders(schedule, pp, m, len(held))[rank], held, working, kept,
                   input_working)


@lru_cache(maxsize=256)  # every layout of a search with this pipeline and rank
def walked_messages(schedule: str, pp: int, micro_batches: int, rank: int,
                    virtual_stages: int,
                    checkpointed: tuple[tuple[bool, ...], ...] | None = None,
                    message: int = 1, inside: int = 0, ring: tuple[int, int] = (0, 0)
                    ) -> int:
    """Peak bytes of pipeline rank `rank`'s message buffers (each `message` bytes: one
    stage's (b, s, h) output, or its gradient), and of what a computation holds of its
    own while it runs: one that forms weight gradients `inside` bytes (sequence
    parallelism's re-gathered (b, s, h) input), ring attention `ring` (a forward's
    block, a backward's or I's blocks: memory.ring_attention_buffers), walked over its
    compute order as the emulator's ledger holds them (parallel/pipeline/executor.py;
    the re-gather and the ring's blocks are held one after the other).
    checkpointed[c]: whether each layer of chunk c is recomputed (default none); a
    split backward's I makes the weight gradients of those, its W those of the others
    and the head's:

        F     of a chunk that is not virtual stage 0: its received input, until its
              gradient is sent back (an input handed over in memory by the chunk
              before it on this rank, DualPipe-V's V tip, is that chunk's output)
        B, I  the received output gradient (but on the last virtual stage); at its end,
              `inside` freed, the input gradient (but on stage 0), which is sent, and
              the input with it, or handed over to the chunk before on this rank as its
              output gradient
        B, W  free the output gradient (an I keeps it for its W, where the chunk's
              last layer makes its weight gradients, unless that layer is checkpointed)

    Walked over min(m, 2p) micro-batches, as walked_peak (the module docstring), so not
    for GPipe, whose forwards all run first: memory.py's closed form, exact for one
    chunk under an unsplit backward, is used there."""
    peak = 0
    for _, _, running, own, after in _message_walk(schedule, pp, micro_batches, rank,
                                                   virtual_stages, checkpointed, message,
                                                   inside, ring):
        peak = max(peak, running + own, after)
    return peak


def _message_walk(schedule: str, pp: int, micro_batches: int, rank: int,
                  virtual_stages: int, checkpointed: tuple[tuple[bool, ...], ...] | None,
                  message: int, inside: int, ring: tuple[int, int]):
    """`walked_messages`' walk, one computation at a time: (kind, chunk, bytes of
    messages held while it runs, its own bytes meanwhile, messages held as it ends with
    the input gradient it made)."""
    spec = SCHEDULES[schedule]
    last = pp * virtual_stages - 1
    stages = [spec.virtual_stage(pp, rank, c) for c in range(virtual_stages)]
    here = set(stages)
    recomputed = checkpointed or ((False,),) * virtual_stages  # (default: one plain layer)
    kept = [not (layers and layers[-1]) for layers in recomputed]  # for the W
    weights = {"F": [False] * virtual_stages, "B": [True] * virtual_stages,
               "I": [any(layers) for layers in recomputed],
               "W": [not all(layers) or stage == last
                     for layers, stage in zip(recomputed, stages, strict=True)]}
    m = walked_micro_batches(schedule, pp, micro_batches)
    now = 0  # messages held
    for kind, c in compute_orders(schedule, pp, m, virtual_stages)[rank]:
        s = stages[c]
        received = s > 0 and s - 1 not in here  # (else handed over: no buffer of its own)
        gradient = s < last
        if kind == "F":
            now += received
        elif kind in ("B", "I"):
            now += gradient and s + 1 not in here  # received (else handed over: held)
        own = max(inside * weights[kind][c], ring[kind in ("B", "I")] * (kind != "W"))
        running = now * message  # while it runs
        if kind in ("B", "I"):
            now += s > 0  # the input gradient it makes
        yield kind, c, running, own, now * message
        if kind in ("B", "I"):
            now -= 2 * received  # sent, and the input with it
            now -= gradient and (kind == "B" or not kept[c])
        elif kind == "W" and kept[c]:
            now -= gradient


@lru_cache(maxsize=256)
def last_backwards(schedule: str, pp: int, micro_batches: int, rank: int,
                   virtual_stages: int, message: int = 1, inside: int = 0,
                   ring: tuple[int, int] = (0, 0),
                   checkpointed: tuple[tuple[bool, ...], ...] | None = None
                   ) -> tuple[tuple[int, str, int, int], ...]:
    """For a backward over several chunks, where each chunk's buckets reduce during the
    last computation that makes its weight gradients (parallel/pipeline/executor.py): a
    B, or under a split backward a W, or the I of a chunk whose layers are all
    checkpointed (`checkpointed` as in `walked_messages`; the first stage's embedding,
    whose gradient the last W makes, is launched after every bucket then:
    backward_buffers.made_by_last_w); per chunk, in the
    order those run, (chunk, its kind, bytes of messages held while it runs, the most
    the computations since the previous chunk's hold: messages, and their own as in
    `walked_messages`)."""
    walk = list(_message_walk(schedule, pp, micro_batches, rank, virtual_stages,
                              checkpointed, message, inside, ring))
    recomputed = checkpointed or ((False,),) * virtual_stages
    makes = [("B", "I") if layers and all(layers) else ("B", "W") for layers in recomputed]
    final = {c: i for i, (kind, c, *_) in enumerate(walk) if kind in makes[c]}
    between, out = 0, []
    for i, (kind, c, running, own, after) in enumerate(walk):
        if final.get(c) == i:
            out.append((c, kind, running, between))
            between = 0
        elif out:
            between = max(between, running + own, after)
    return tuple(out)
