"""Pipeline schedules as data, registered by name: per pipeline rank, the actions it runs.

    schedule = make_schedule("1f1b", pp=4, micro_batches=8)
    print(schedule)                 # one line per rank: F0 send act 0 -> 1 F1 ...
    schedule[2]                     # rank 2's actions: [RecvActivation(0, 0, 1), Forward(0), ...]
    validate(schedule)              # raises ScheduleError naming the first problem
    timeline = simulate(schedule)   # ideal timings with unit-cost stages, free communication
    SCHEDULES["interleaved"]        # what the schedule declares about itself (ScheduleSpec)

The actions and the Schedule are in pipeline_actions.py, the simulator that checks and
times them in pipeline_simulator.py (both re-exported here). This module is the one home
of the schedules (long because it holds the registry and every generator, seven of them
since the zero-bubble ones): each is a generator
function plus a `ScheduleSpec` in the registry `SCHEDULES`, declaring its model chunks
per rank and how they map to virtual stages, its settings rules, its bubble and its
activations in flight for uniform stages. TrainConfig, the CLI choices, the planner, the
report schema and the explorers all read the registry, so adding a schedule is one
generator and one `register_schedule` call (docs/pipeline-parallel.md, "Adding a schedule").

Three schedules, all "flushing" (every micro-batch of an optimizer step finishes before the
weights change, so the result equals single-device gradient accumulation):
- GPipe (Huang et al. 2019): every forward, then every backward. Holds the activations of
  all m micro-batches at once.
- 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", section 2.2.1, Figure 3): stage s runs
  p - s - 1 warm-up forwards, then alternates one forward and one backward, then cools
  down. Same bubble as GPipe, but at most p - s micro-batches in flight.
- Interleaved 1F1B (same paper, section 2.2.2, Figure 4): each rank holds v model chunks
  (chunk c of rank r is virtual stage c*p + r) and micro-batches go through the chunks in
  groups of p. The bubble shrinks by v: (p - 1) / (v*m + p - 1) of the time, for
  v times more point-to-point messages. Order and warm-up follow Megatron-LM's
  `forward_backward_pipelining_with_interleaving`, so m must be a multiple of p.

Bubble with uniform stages and free communication (t_f, t_b: forward and backward time of
one micro-batch on one stage), from section 2.2 of the paper (`uniform_bubble_fraction`):
    GPipe, 1F1B:   idle / total = (p - 1) / (m + p - 1)
    interleaved:   idle / total = (p - 1) / (v*m + p - 1)    (bubble (1/v)(p-1)/m of ideal)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from minipar.errors import ScheduleError
from minipar.parallel.pipeline.actions import (
    PLACEMENTS,
    Schedule,
    from_compute_orders,
)
from minipar.parallel.pipeline.simulator import (
    validate,
)


# --------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule declares about itself; every caller reads these, none restates them.

    generate(pp, micro_batches, virtual_stages) -> Schedule: the generator.
    uniform_bubble(p, m, v): idle / total rank-time with uniform stages and free
      communication; bubble_formula: the same, printed ("(p-1)/(m+p-1)").
    in_flight(p, m, v, rank): peak chunk forwards whose backward has not run on `rank`
      (micro-batches of activations held); last_stage_in_flight(p, m, v): the same for
      the chunk holding the last virtual stage (the head's activations), default
      in_flight of the last rank.
    virtual_stages: (fewest, most) model chunks per rank, most None = no limit;
    placement: how (rank, chunk) maps to a virtual stage (pipeline_actions.PLACEMENTS);
    min_pp: fewest pipeline ranks; micro_batches_multiple_of_pp: Megatron's rule for
    interleaving; min_micro_batches(p): fewest micro-batches (the zero-bubble schedules'
    steady state needs them); searched_virtual_stages: the chunk counts the planner's
    layout search tries (none: the search skips it, as it skips GPipe, which 1F1B
    dominates).
    bubble_time(p, m, v, t_f, t_b, t_w): idle seconds per rank in one step, uniform stages
      and free communication, with t_f the forward, t_b the input-gradient half of the
      backward (B, printed I) and t_w the weight-gradient half (W) of one micro-batch
      through one chunk: the papers' bubble columns (ZB paper Table 2, DualPipe's README),
      which assume t_w <= t_f and t_w <= t_b. uniform_bubble is its share of the step at
      t_f = t_b = t_w.
    """

    name: str
    generate: Callable[[int, int, int], Schedule]
    description: str
    uniform_bubble: Callable[[int, int, int], float]
    bubble_formula: str
    in_flight: Callable[[int, int, int, int], int]
    last_stage_in_flight: Callable[[int, int, int], int] | None = None
    virtual_stages: tuple[int, int | None] = (1, 1)
    placement: str = "looped"
    min_pp: int = 1
    micro_batches_multiple_of_pp: bool = False
    searched_virtual_stages: tuple[int, ...] = ()
    min_micro_batches: Callable[[int], int] = lambda pp: 1
    bubble_time: Callable[[int, int, int, float, float, float], float] | None = None

    def accepts_chunks(self, virtual_stages: int) -> bool:
        fewest, most = self.virtual_stages
        return fewest <= virtual_stages and (most is None or virtual_stages <= most)

    def virtual_stage(self, pp: int, rank: int, chunk: int) -> int:
        return PLACEMENTS[self.placement](pp, rank, chunk)

    def head_in_flight(self, pp: int, micro_batches: int, virtual_stages: int) -> int:
        if self.last_stage_in_flight is not None:
            return self.last_stage_in_flight(pp, micro_batches, virtual_stages)
        return self.in_flight(pp, micro_batches, virtual_stages, pp - 1)


SCHEDULES: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a schedule to the registry (its name must be new); returns it."""
    if spec.name in SCHEDULES:
        raise ValueError(f"a pipeline schedule called {spec.name!r} is already registered")
    if spec.placement not in PLACEMENTS:
        raise ValueError(f"placement {spec.placement!r} is not one of {', '.join(PLACEMENTS)}")
    SCHEDULES[spec.name] = spec
    return spec


def schedule_names() -> tuple[str, ...]:
    """The registered schedules' names, in registration order (the CLI's choices)."""
    return tuple(SCHEDULES)


def _schedule_error(setting: str, message: str) -> ScheduleError:
    return ScheduleError(f"--{setting.replace('_', '-')}: {message}")


def check_schedule_name(name: str, error=_schedule_error) -> ScheduleSpec:
    """The spec of schedule `name`; raise error("schedule", message) if there is none.

    `error(setting, message)` builds the exception: ScheduleError here, ConfigError in
    TrainConfig, PlanError in the planner, so each rule's message is written once."""
    if name not in SCHEDULES:
        raise error("schedule", f"unknown pipeline schedule {name!r}; use one of "
                                f"{', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def check_schedule_settings(name: str, pp: int, micro_batches: int,
                            virtual_stages: int = 1, error=_schedule_error) -> None:
    """Raise error(setting, message), naming the flag and the fix, if schedule `name`
    cannot schedule these settings (by the rules its ScheduleSpec declares)."""
    spec = check_schedule_name(name, error)
    fewest, most = spec.virtual_stages
    v, m = virtual_stages, micro_batches
    others = [n for n, s in SCHEDULES.items() if s.accepts_chunks(v) and s.min_pp <= pp]
    instead = f", or --schedule {' or '.join(others)}" if others else ""
    if v < fewest:
        # the fix must pass the next rule too: name the micro-batch count it also needs
        also = (f" with --grad-accum-steps a multiple of {pp}"
                if spec.micro_batches_multiple_of_pp and m % pp else "")
        needs = (f"exactly {fewest} model chunks" if most == fewest
                 else f"at least {fewest} model chunks")
        raise error("virtual_stages", f"the {name} schedule needs {needs} per rank; use "
                    f"--virtual-stages {fewest}{also}{instead}")
    if most is not None and v > most:
        runs = ("one model chunk" if most == 1 else f"exactly {most} model chunks"
                if most == fewest else f"at most {most} model chunks")
        needs = (f"needs --schedule {' or '.join(others)}, or use" if others
                 else "is too many: use")
        raise error("virtual_stages", f"the {name} schedule runs {runs} per rank; "
                    f"--virtual-stages {v} {needs} --virtual-stages {most}")
    if pp < spec.min_pp:
        raise error("pp", f"the {name} schedule needs at least {spec.min_pp} pipeline "
                    f"ranks; use --pp {spec.min_pp} or more{instead}")
    fewest_micro_batches = spec.min_micro_batches(pp)
    if m < fewest_micro_batches:
        raise error("grad_accum_steps", f"the {name} schedule needs at least "
                    f"{fewest_micro_batches} micro-batches for pp={pp} (its steady state "
                    f"does not exist with fewer); got {m}: use --grad-accum-steps "
                    f"{fewest_micro_batches} or more")
    if spec.micro_batches_multiple_of_pp and m % pp:
        lower = max(pp, m // pp * pp)
        raise error("grad_accum_steps", f"the {name} schedule sends micro-batches through "
                    f"the model chunks in groups of pp={pp}, so the micro-batch count must "
                    f"be a multiple of {pp} (Megatron-LM has the same rule); got {m}: use "
                    f"--grad-accum-steps {lower} or {lower + pp}")


def uniform_bubble_fraction(name: str, pp: int, micro_batches: int,
                            virtual_stages: int = 1) -> float:
    """Idle / total rank-time of schedule `name` with uniform stages and free
    communication (the papers' formula; the simulated clocks measure the real one)."""
    return check_schedule_name(name).uniform_bubble(pp, micro_batches, virtual_stages)


def make_schedule(name: str, pp: int, micro_batches: int, virtual_stages: int = 1, *,
                  validated: bool = True) -> Schedule:
    """The registered schedule called `name` (see schedule_names()), validated (unless
    validated=False, for a caller that runs it through simulate_step, which validates as
    it times)."""
    _check_sizes(pp, micro_batches, virtual_stages)
    check_schedule_settings(name, pp, micro_batches, virtual_stages)
    generate = SCHEDULES[name].generate
    if validated:
        return _validated(generate, pp, micro_batches, virtual_stages)
    return generate(pp, micro_batches, virtual_stages)


@functools.lru_cache(maxsize=256)
def _validated(generate, pp: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """generate(pp, m, v), validated, once per generator and sizes: every pipeline rank of
    a run builds the same schedule, and the notebook explorers build the same ones again
    (validating is a simulated step: ~2 ms per rank for p=8, m=16, a tenth of the
    pipeline explorer's run). A Schedule is frozen, so one copy serves them all; a
    generator that fails validation is not remembered."""
    schedule = generate(pp, micro_batches, virtual_stages)
    validate(schedule)
    return schedule


def _check_sizes(pp: int, micro_batches: int, virtual_stages: int = 1) -> None:
    for name, value in (("pp", pp), ("micro_batches (grad_accum_steps)", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"schedule: {name} must be a positive integer, got {value!r}")


def flushing_bubble(p: int, m: int, v: int) -> float:
    """(p - 1) / (v m + p - 1): GPipe and 1F1B (v = 1), interleaved (Narayanan et al.
    2021, section 2.2): (p - 1) chunk slots of fill and drain against v m of work."""
    return (p - 1) / (v * m + p - 1)


# --------------------------------------------------------------------------- generators
def gpipe(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe: all m forwards, then all m backwards (Huang et al. 2019, Figure 2c)."""
    _check_sizes(pp, micro_batches, virtual_stages)
    check_schedule_settings("gpipe", pp, micro_batches, virtual_stages)
    m = micro_batches
    order = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    return from_compute_orders("gpipe", pp, m, 1, [order] * pp)


register_schedule(ScheduleSpec(
    "gpipe", gpipe, "every forward, then every backward (Huang et al. 2019)",
    uniform_bubble=flushing_bubble, bubble_formula="(p-1)/(m+p-1)",
    bubble_time=lambda p, m, v, f, b, w: (p - 1) * (f + b + w),
    in_flight=lambda p, m, v, rank: m))


def one_f_one_b(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush: stage s runs min(p - s - 1, m) warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards (cool-down)."""
    _check_sizes(pp, micro_batches, virtual_stages)
    check_schedule_settings("1f1b", pp, micro_batches, virtual_stages)
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


register_schedule(ScheduleSpec(
    "1f1b", one_f_one_b, "warm-up forwards, then one forward and one backward in turn "
    "(PipeDream-Flush; Narayanan et al. 2021, 2.2.1)",
    uniform_bubble=flushing_bubble, bubble_formula="(p-1)/(m+p-1)",
    bubble_time=lambda p, m, v, f, b, w: (p - 1) * (f + b + w),
    in_flight=lambda p, m, v, rank: min(p - rank, m), searched_virtual_stages=(1,)))


def interleaved_1f1b(pp: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B with v model chunks per rank (Narayanan et al. 2021, Figure 4).

    The k-th forward of a rank (k = 0 .. m*v - 1) is micro-batch (k // (p*v)) * p + k % p
    on chunk (k // p) % v: p micro-batches go through chunk 0, the same p through chunk 1,
    and so on; backwards visit the chunks in reverse. Rank r runs
    2 (p - r - 1) + (v - 1) p warm-up forwards (all of them when m == p), then 1F1B, then
    cools down, as Megatron-LM does.
    """
    _check_sizes(pp, micro_batches, virtual_stages)
    p, m, v = pp, micro_batches, virtual_stages
    check_schedule_settings("interleaved", p, m, v)
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
    bubble_time=lambda p, m, v, f, b, w: (p - 1) * (f + b + w),
    in_flight=_interleaved_in_flight,
    # the last chunk runs each micro-batch's backward right after its forward, unless
    # every forward runs first (m = p)
    last_stage_in_flight=lambda p, m, v: m if m == p else 1,
    virtual_stages=(2, None), min_pp=2, micro_batches_multiple_of_pp=True,
    searched_virtual_stages=(2,)))


# --------------------------------------------------------------------------- zero bubble
# Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024): the backward is
# split into B (printed I: the input gradient, which the previous stage waits for) and W
# (the weight gradients, which nobody waits for), and W fills the bubbles. Table 2's
# bubble per stage: 1F1B (p-1)(T_F+T_B+T_W), ZB-H1 (p-1)(T_F+T_B-T_W), ZB-H2
# (p-1)(T_F+T_B-2T_W). The executor runs I with minipar.autograd.engine.backward_input
# and W with the WeightGradient it returns.
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
    _check_sizes(pp, micro_batches, virtual_stages)
    check_schedule_settings("zb-h1", pp, micro_batches, virtual_stages)
    return _delayed_w("zb-h1", pp, micro_batches, lambda r: pp - r - 1, lambda r: r)


def _zero_bubble_share(bubble_time):
    """The idle share of the step at T_F = T_B = T_W (one chunk of work costs 3 units)."""
    def share(p, m, v):
        idle = bubble_time(p, m, v, 1.0, 1.0, 1.0)
        return idle / (idle + 3 * m * v)
    return share


def _zb_h1_bubble(p, m, v, f, b, w):
    return (p - 1) * (f + b - w)


register_schedule(ScheduleSpec(
    "zb-h1", zb_h1, "1F1B with the backward split in B and W, W delayed into the "
    "cool-down (Qi et al. 2024, ZB-H1)",
    uniform_bubble=_zero_bubble_share(_zb_h1_bubble), bubble_formula="(p-1)/(3m+p-1)",
    bubble_time=_zb_h1_bubble, in_flight=lambda p, m, v, rank: p,
    min_micro_batches=lambda p: p))


def zb_h2(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H2 (Qi et al. 2024, section 3.1, Figure 3 bottom): 2(p-r-1) warm-up forwards
    fill the wait for the first gradient and rank r delays its W's by 2r, so every rank
    holds 2p-1 micro-batches between F and W and the step is a parallelogram: no bubble
    inside it when T_F + T_B <= 2 T_W. What is left is the skew: rank r starts r T_F
    late and ends r T_F late, and the optimizer step waits for the last rank (the
    gradient-norm all-reduce), so (p-1) T_F per step stays idle; the paper's
    post-validation lets the next step start before that sync to remove it."""
    _check_sizes(pp, micro_batches, virtual_stages)
    check_schedule_settings("zb-h2", pp, micro_batches, virtual_stages)
    return _delayed_w("zb-h2", pp, micro_batches, lambda r: 2 * (pp - r - 1),
                      lambda r: 2 * r)


def _zb_h2_bubble(p, m, v, f, b, w):
    # Table 2's (p-1)(T_F+T_B-2T_W), but never below the skew a synchronised step keeps
    return (p - 1) * max(f, f + b - 2 * w)


register_schedule(ScheduleSpec(
    "zb-h2", zb_h2, "more warm-up forwards and W delayed further: a parallelogram, "
    "no bubble inside the step (Qi et al. 2024, ZB-H2)",
    uniform_bubble=_zero_bubble_share(_zb_h2_bubble), bubble_formula="(p-1)/(3m+p-1)",
    bubble_time=_zb_h2_bubble, in_flight=lambda p, m, v, rank: 2 * p - 1,
    min_micro_batches=lambda p: 2 * p - 1))


def zb_v(pp: int, micro_batches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6, Figure 8): two chunks per rank in a V (chunk 1 of
    rank r is virtual stage 2p-1-r, so rank 0 holds the first and the last stage), the
    backward split in I and W, 1F1B's peak activation memory. The order is PyTorch's
    `ScheduleZBVZeroBubble._calculate_single_rank_operations`
    (torch/distributed/pipelining/schedules.py): 2(p-r)-1 forwards of chunk 0, then r
    pairs F chunk 1 / F chunk 0, then p-r triples F I W on chunk 1, a steady state of
    F I W on chunk 0 then chunk 1, and a cool-down of I's whose W's come last."""
    _check_sizes(pp, micro_batches, virtual_stages)
    p, m = pp, micro_batches
    check_schedule_settings("zb-v", p, m, virtual_stages)
    return from_compute_orders("zb-v", p, m, 2, [_zb_v_rank(p, m, r) for r in range(p)],
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


def dualpipe_v(pp: int, micro_batches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipe-V (DeepSeek-V3 report section 3.2.1; the "cut-in-half" V of Sea AI Lab's
    blog): DeepSeek's `DualPipeV.step` (dualpipe/dualpipev.py, steps 1-8) replayed with
    counters per chunk ("phase") and a first-in first-out queue of W's, as its
    WeightGradStore pops them. Chunk 0 runs down the ranks, chunk 1 back up (the loss on
    rank 0). `_forward_backward_chunk(a, b)`, the forward of chunk a's next micro-batch
    overlapped with the full backward of chunk b's, is an F followed by a B here: minipar
    has no communication inside a chunk to hide (DualPipe overlaps the MoE all-to-all
    with the other's compute), so on the simulated clock F&B costs F + B."""
    _check_sizes(pp, micro_batches, virtual_stages)
    p, m = pp, micro_batches
    check_schedule_settings("dualpipe-v", p, m, virtual_stages)
    return from_compute_orders("dualpipe-v", p, m, 2,
                               [_dualpipe_v_rank(p, m, r) for r in range(p)], placement="v")


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


def _v_share(p: int, m: int, v: int) -> float:
    """Measured, not a paper's formula: at T_F = T_B = T_W both V schedules leave (p-1)
    chunk slots idle per rank (the skew of a synchronised step) against 2 x 3m of work.
    (DualPipe's README gives (2p/2-1)(F&B+B-3W) = 2(p-1) slots for DualPipe-V with
    F&B = F + B; the ZB paper's ZB-V figure has none inside the step.)"""
    return (p - 1) / (6 * m + p - 1)


register_schedule(ScheduleSpec(
    "zb-v", zb_v, "two chunks per rank in a V, backward split in B and W (Qi et al. "
    "2024, ZB-V)",
    uniform_bubble=_v_share, bubble_formula="(p-1)/(6m+p-1)",
    # 2p chunk-halves of a stage: 1F1B's p micro-batches of one stage's activations
    in_flight=lambda p, m, v, rank: 2 * p, last_stage_in_flight=lambda p, m, v: 1,
    virtual_stages=(2, 2), placement="v", min_pp=2, min_micro_batches=lambda p: 2 * p - 1))

register_schedule(ScheduleSpec(
    "dualpipe-v", dualpipe_v, "DeepSeek's V-shaped DualPipe: forward of one micro-batch "
    "with the backward of another (DeepSeek-V3, DualPipeV)",
    uniform_bubble=_v_share, bubble_formula="(p-1)/(6m+p-1)",
    # DualPipe's README: PP + 1 chunks of activations (PP = 2p stages)
    in_flight=lambda p, m, v, rank: 2 * p + 1, last_stage_in_flight=lambda p, m, v: 1,
    virtual_stages=(2, 2), placement="v", min_pp=2, min_micro_batches=lambda p: 2 * p))
