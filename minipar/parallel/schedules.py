"""Pipeline schedules as data, registered by name: per pipeline rank, the actions it runs.

    schedule = make_schedule("1f1b", pp=4, micro_batches=8)
    print(schedule)                 # one line per rank: F0 send act 0 -> 1 F1 ...
    schedule[2]                     # rank 2's actions: [RecvActivation(0, 0, 1), Forward(0), ...]
    validate(schedule)              # raises ScheduleError naming the first problem
    timeline = simulate(schedule)   # ideal timings with unit-cost stages, free communication
    SCHEDULES["interleaved"]        # what the schedule declares about itself (ScheduleSpec)

The actions, the Schedule and the simulator that checks them are in pipeline_actions.py
(re-exported here). This module is the one home of the schedules: each is a generator
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

from collections.abc import Callable
from dataclasses import dataclass

from minipar.parallel.pipeline_actions import (  # noqa: F401 - re-exported: the public home
    ACTION_TYPES,
    COMPUTE,
    PLACEMENTS,
    Action,
    Backward,
    Forward,
    PipelineError,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
    SimulatedStep,
    from_compute_orders,
    in_flight_peak,
    simulate,
    simulate_step,
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
    interleaving; searched_virtual_stages: the chunk counts the planner's layout search
    tries (none: the search skips it, as it skips GPipe, which 1F1B dominates).
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
        raise error("virtual_stages", f"the {name} schedule needs at least {fewest} model "
                    f"chunks per rank; use --virtual-stages {fewest}{instead}")
    if most is not None and v > most:
        runs = "one model chunk" if most == 1 else f"at most {most} model chunks"
        needs = (f"needs --schedule {' or '.join(others)}, or use" if others
                 else "is too many: use")
        raise error("virtual_stages", f"the {name} schedule runs {runs} per rank; "
                    f"--virtual-stages {v} {needs} --virtual-stages {most}")
    if pp < spec.min_pp:
        raise error("pp", f"the {name} schedule needs at least {spec.min_pp} pipeline "
                    f"ranks; use --pp {spec.min_pp} or more{instead}")
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
    schedule = SCHEDULES[name].generate(pp, micro_batches, virtual_stages)
    if validated:
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
    in_flight=_interleaved_in_flight,
    # the last chunk runs each micro-batch's backward right after its forward, unless
    # every forward runs first (m = p)
    last_stage_in_flight=lambda p, m, v: m if m == p else 1,
    virtual_stages=(2, None), min_pp=2, micro_batches_multiple_of_pp=True,
    searched_virtual_stages=(2,)))
