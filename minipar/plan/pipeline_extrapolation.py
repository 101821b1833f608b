"""How far the planner walks a pipelined step (pipeline_step.walked_step_time).

The simulation visits every action (~20 us each), and `minipar plan` must answer in
seconds for any input it takes (--pp 64 --grad-accum-steps 65,536 is 8 million
computations; lint times up to five variants). So a step of at most SIMULATED_ACTIONS
computations is walked whole. A longer one is walked at three smaller micro-batch counts
m0, m0 + d and m0 + 2d (m0 >= p fills the pipeline, d ~ m0 / 2; all congruent to m
modulo the group of micro-batches the schedule takes: p for the interleaved one, else 1)
and extrapolated: once the pipeline is full, every further d micro-batches add the same
time to every rank's end, to the pipeline's span and to the busy time. Both are checked
on the walks: equal increments (to 1e-9), at least the busiest rank's work per micro-
batch (below it the pipeline is still absorbing work: ZB-V and DualPipe-V defer weight
gradients for ~4-6p micro-batches), else m0 is doubled. In the tests the extrapolated
step equals the whole walk to 1e-9 (relative). A rank's exposed communication wobbles by
a message from one micro-batch to the next, so it is extrapolated from the walks' whole
span: within 0.5% of the step in the tests. When the walks would cost more than
EXTRAPOLATED_ACTIONS (p above ~65), simulated_step_time returns None and the estimate
falls back to the closed form (timing.step_time), which `minipar plan` says.
"""

from __future__ import annotations

import functools

from minipar.parallel.pipeline.schedules.registry import check_schedule_name
from minipar.plan import pipeline_step
from minipar.plan.cluster import ClusterSpec
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import ModelShape

# Forward and backward computations walked (module docstring): ~0.4 s for one walk, and
# for the three walks of an extrapolation, ~0.8 s.
SIMULATED_ACTIONS = 20_000
EXTRAPOLATED_ACTIONS = 40_000


def simulated_step_time(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                        scatter_gather: bool = False) -> dict[str, float] | None:
    """`walked_step_time` of the config, walked whole, or extrapolated from its steady
    state, or None when neither fits the budget (module docstring). The result has
    `simulated_micro_batches`: the micro-batch counts walked."""
    found = _simulated(shape, config, cluster, scatter_gather)
    return None if found is None else {k: list(v) if isinstance(v, list) else v
                                       for k, v in found.items()}  # (a copy: callers edit)


def compute_actions(config: ParallelConfig, micro_batches: int | None = None) -> int:
    """Forward and backward computations of one step's schedule: 2 x p x m x v."""
    m = config.micro_batches if micro_batches is None else micro_batches
    return 2 * config.pp * m * config.virtual_stages


@functools.lru_cache(maxsize=16)  # lint and the table time the same layout
def _simulated(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
               scatter_gather: bool) -> dict | None:
    if compute_actions(config) <= SIMULATED_ACTIONS:
        return {**pipeline_step.walked_step_time(shape, config, cluster, scatter_gather),
                "simulated_micro_batches": [config.micro_batches]}
    spec = check_schedule_name(config.schedule)
    p, m = config.pp, config.micro_batches
    q = p if spec.micro_batches_multiple_of_pp else 1
    fewest = -(-max(p, spec.min_micro_batches(p)) // q) * q  # the pipeline full, valid
    forward, backward, _ = pipeline_step.chunk_costs(shape, config, cluster)
    busiest = max(sum(forward[r]) + sum(backward[r]) for r in range(p))
    for first in (fewest, 2 * fewest, 4 * fewest, 8 * fewest):
        start = first + (m - first) % q  # congruent to m mod q
        apart = q * -(-first // (2 * q))  # half the pipeline's fill, a whole number of q
        counts = [start, start + apart, start + 2 * apart]
        if counts[-1] >= m or sum(compute_actions(config, c) for c in counts) > \
                EXTRAPOLATED_ACTIONS:
            return None
        walks = [pipeline_step.walked_step_time(shape, config.replace(grad_accum_steps=c),
                                                cluster, scatter_gather) for c in counts]
        extrapolated = _extrapolate(walks, counts, m, busiest, shape, config, cluster)
        if extrapolated is not None:
            return {**extrapolated, "simulated_micro_batches": counts}
    return None


def _extrapolate(walks: list[dict], counts: list[int], m: int, busiest: float,
                 shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec
                 ) -> dict | None:
    """walked_step_time at m micro-batches from its walks at counts (equally apart, and
    congruent to m modulo the schedule's group of micro-batches), or None if the walks
    are not in the steady state: their increments differ, or the step grows by less than
    the busiest rank's work per micro-batch (`busiest` seconds: no rank can go faster for
    ever; below it the pipeline is still absorbing work, as ZB-V and DualPipe-V do while
    their deferred weight gradients pile up)."""
    p = config.pp
    apart = counts[1] - counts[0]
    steps = (m - counts[-1]) / apart
    if walks[2]["step_s"] - walks[1]["step_s"] < apart * busiest * (1 - 1e-9):
        return None

    def busy(walk: dict) -> float:  # compute and communication time, over the p ranks
        return (1 - walk["bubble_fraction"]) * p * walk["pipeline_s"]

    def ahead(values: list[float], check: bool = True) -> float | None:
        first, second = values[1] - values[0], values[2] - values[1]
        if check and abs(second - first) > 1e-9 * max(abs(v) for v in values):
            return None
        return values[2] + steps * second

    timed = {key: ahead([w[key] for w in walks]) for key in ("step_s", "pipeline_s")}
    ends = [ahead(list(column))
            for column in zip(*(w["rank_end_s"] for w in walks), strict=True)]
    worked = ahead([busy(w) for w in walks])
    if None in (*timed.values(), *ends, worked):
        return None
    # a rank's exposed communication wobbles from one micro-batch to the next (a message
    # that overlaps compute or not): its increment is taken over the walks' whole span
    exposed = [ahead(list(column), check=False)
               for column in zip(*(w["rank_exposed_comm_s"] for w in walks), strict=True)]
    step, pipeline = timed["step_s"], timed["pipeline_s"]
    model_flops = shape.model_flops_per_sequence() * config.global_batch_size
    return {**walks[-1], "step_s": step, "rank_end_s": ends, "rank_exposed_comm_s": exposed,
            "pipeline_s": pipeline, "tail_s": step - pipeline,
            "bubble_fraction": 1 - worked / (p * pipeline), "model_flops": model_flops,
            "mfu": model_flops / (step * config.world_size * cluster.peak_flops),
            "tokens_per_s": config.global_batch_size * shape.seq_len / step}
