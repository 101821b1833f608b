"""The registry of pipeline schedules: what each one declares about itself, its rules.

    make_schedule("1f1b", pp=4, micro_batches=8)   # checked, generated, validated
    SCHEDULES["interleaved"]                       # its ScheduleSpec: chunks, placement,
                                                   # rules, bubble, activations in flight
    check_schedule_settings("zb-v", 4, 6, 2)       # the rules, as one error naming the fix

Each schedule module (gpipe and 1F1B, interleaved, zero bubble, DualPipe-V) registers its
generators with one `register_schedule(ScheduleSpec(...))` call each. TrainConfig, the
layout check, both CLIs' choices, the planner, the report schema and the explorers read
`SCHEDULES`, so a schedule's rules and formulas are written once, in its spec, and are
checked here once: `make_schedule` checks the settings against the spec before it calls
the generator, so the generators trust their arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from minipar.errors import ScheduleError
from minipar.parallel.pipeline.actions import Schedule
from minipar.parallel.pipeline.placements import PLACEMENTS
from minipar.parallel.pipeline.simulator import validate


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
    placement: how (rank, chunk) maps to a virtual stage (placements.PLACEMENTS);
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
    split_backward: whether its ranks run a backward as an input-gradient half (I) and a
      weight-gradient half (W) apart (split_backward.py), so a micro-batch keeps what
      its W needs after the I (the planner walks that: plan/walked_activations.py).
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
    split_backward: bool = False

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


# --------------------------------------------------------------------------- the rules
def _schedule_error(setting: str, message: str) -> ScheduleError:
    return ScheduleError(f"--{setting.replace('_', '-')}: {message}")


def check_schedule_name(name: str, error=_schedule_error) -> ScheduleSpec:
    """The spec of schedule `name`; raise error("schedule", message) if there is none.

    `error(setting, message)` builds the exception: ScheduleError here, ConfigError in
    TrainConfig and the planner, so each rule's message is written once."""
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


def _check_sizes(pp: int, micro_batches: int, virtual_stages: int) -> None:
    """Positive integers: TrainConfig and the planner's ParallelConfig check their fields
    before they call the rules; a direct caller of make_schedule is answered here."""
    for name, value in (("pp", pp), ("micro_batches (grad_accum_steps)", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"schedule: {name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------- readers
def uniform_bubble_fraction(name: str, pp: int, micro_batches: int,
                            virtual_stages: int = 1) -> float:
    """Idle / total rank-time of schedule `name` with uniform stages and free
    communication (the papers' formula; the simulated clocks measure the real one)."""
    return check_schedule_name(name).uniform_bubble(pp, micro_batches, virtual_stages)


def make_schedule(name: str, pp: int, micro_batches: int, virtual_stages: int = 1, *,
                  validated: bool = True) -> Schedule:
    """The registered schedule called `name` (see schedule_names()) for these settings,
    checked against its rules, then validated (unless validated=False, for a caller that
    runs it through simulate_step, which validates as it times)."""
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
