"""A pipelined step, exactly: the schedule simulated over every (rank, chunk)'s costs,
then the step's tail in the order minipar runs it.

`chunk_costs` prices one micro-batch's forward and backward of each model chunk on its
pipeline rank (compute on the roofline, the TP collectives and ZeRO-3 gathers it waits
for, a ring's exposed hops: timing.py's per-micro-batch model); the schedule registry's
simulator (minipar.parallel.pipeline.simulator.simulate_step, the one the trainer's
schedules are validated with) walks the schedule's actions over them with a message
cost per hop (`p2p_message_seconds`); `simulated_step_time` adds the tail: the tied
embedding's and the loss's collectives, each rank's data-parallel reduction (hidden as
far as overlap.py says), the gradient norm's all-reduces and the optimizer. The closed
form for uniform stages (timing.step_time) is what this reduces to when stages are
equal and messages free.

How far it walks. The simulation visits every action (~20 us each), and `minipar plan`
must answer in seconds for any input it takes (--pp 64 --grad-accum-steps 65,536 is 8
million computations; lint times up to five variants). So a step of at most
SIMULATED_ACTIONS computations is walked whole. A longer one is walked at three smaller
micro-batch counts m0, m0 + d and m0 + 2d (m0 >= p fills the pipeline, d ~ m0 / 2; all
congruent to m modulo the group of micro-batches the schedule takes: p for the
interleaved one, else 1) and extrapolated: once the pipeline is full, every further d
micro-batches add the same time to every rank's end, to the pipeline's span and to the
busy time. Both are checked on the walks: equal increments (to 1e-9), at least the
busiest rank's work per micro-batch (below it the pipeline is still absorbing work: ZB-V
and DualPipe-V defer weight gradients for ~4-6p micro-batches), else m0 is doubled. In
the tests the extrapolated step equals the whole walk to 1e-9 (relative). A rank's
exposed communication wobbles by a message from one micro-batch to the next, so it is
extrapolated from the walks' whole span: within 0.5% of the step in the tests. When the
walks would cost more than EXTRAPOLATED_ACTIONS (p above ~65), simulated_step_time
returns None and the estimate falls back to the closed form (timing.step_time), which
`minipar plan` says.
"""

from __future__ import annotations

import functools

from minipar.distributed.timeline import comm_overlap
from minipar.parallel.pipeline.actions import (
    Backward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.schedules.registry import check_schedule_name, make_schedule
from minipar.parallel.pipeline.simulator import simulate_step
from minipar.parallel.pipeline.split_backward import BackwardInput, BackwardWeight
from minipar.plan.buckets import back_to_back, split_back_to_back
from minipar.plan.cluster import ClusterSpec
from minipar.plan.layout import (
    ParallelConfig,
    StagePlan,
    checkpointed_layers,
    chunk_moe_layers,
    layer_counts,
    pipeline_hops_crossing,
    stage_plan,
)
from minipar.plan.offload import offload_time
from minipar.plan.overlap import data_parallel_time, pipeline_reduction
from minipar.plan.shapes import ModelShape
from minipar.plan.timing import (
    dp_collective,
    group_links,
    optimizer_seconds,
    overlap_contention_seconds,
    overlap_needs_times,
    overlap_priced,
    ring_seconds,
    stage_modules,
    stage_seconds,
    tp_overlap_hidden,
    transfer_time,
    weight_collective_seconds,
)
from minipar.plan.traffic import (
    GRADIENT_NORM,
    PARAMETER_ALL_GATHER,
    SEQUENCE_PARALLEL_GRADIENTS,
    stage_traffic,
)

P2P_ACTIONS = (SendActivation, SendGrad, RecvActivation, RecvGrad)
# Forward and backward computations walked (module docstring): ~0.4 s for one walk, and
# for the three walks of an extrapolation, ~0.8 s.
SIMULATED_ACTIONS = 20_000
EXTRAPOLATED_ACTIONS = 40_000


def chunk_costs(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec
                ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Seconds of one micro-batch's forward and backward of every (rank, chunk), with the
    tensor-parallel collectives and ZeRO-3 gathers it waits for; and of each backward
    the weight gradients' compute (the W a zero-bubble schedule runs apart)."""
    p, v, m = config.pp, config.virtual_stages, config.micro_batches
    counts = layer_counts(shape.n_layer, p * v, config.layer_split)
    links = group_links(config, cluster)
    spec = check_schedule_name(config.schedule)
    forward = [[0.0] * v for _ in range(p)]
    backward = [[0.0] * v for _ in range(p)]
    weight = [[0.0] * v for _ in range(p)]
    for r in range(p):
        for c in range(v):
            stage = spec.virtual_stage(p, r, c)  # the schedule's placement (c p + r, or a V)
            chunk = StagePlan(rank=r, chunk_layers=(counts[stage],), first=stage == 0,
                              last=stage == p * v - 1, tied_copy=False, in_flight=1,
                              chunk_moe_layers=(chunk_moe_layers(shape, counts, stage),))
            compute = stage_seconds(shape, config, cluster, chunk)
            seconds = {"forward": compute["forward"], "backward": compute["backward"]}
            ring = ring_seconds(shape, config, cluster, chunk.chunk_layers, split=True)
            seconds["forward"] += ring[0]
            seconds["backward"] += ring[1]
            for transfer in stage_traffic(shape, config, chunk, cluster.gpus_per_node):
                if (transfer.phase in seconds and transfer.group not in ("pp", "cp")
                        and transfer.label != SEQUENCE_PARALLEL_GRADIENTS):  # (the tail's)
                    seconds[transfer.phase] += transfer.count / m * transfer_time(
                        transfer, cluster, links[transfer.link])
            hidden = tp_overlap_hidden(shape, config, cluster, chunk)  # --tp-comm-overlap
            forward[r][c] = seconds["forward"] - hidden["forward"]
            backward[r][c] = seconds["backward"] - hidden["backward"]
            # W: the weight gradients, and its own collectives (the inputs gathered again)
            weight[r][c] = min(compute["weight"] + weight_collective_seconds(
                shape, config, cluster, chunk), backward[r][c])
    return forward, backward, weight


def p2p_message_seconds(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                        scatter_gather: bool = False):
    """`seconds(sender, receiver)` of one pipeline message, a micro-batch's (b, s, h)
    activation or its gradient, between two neighbouring pipeline ranks: over the network
    on a hop between nodes (layout.pipeline_hops_crossing), else over NVLink.

    scatter_gather: Megatron-LM's optimisation of pipeline messages across tensor
    parallelism (Narayanan et al. 2021, section 4.1; megatron/p2p_communication.py): the
    t ranks of a stage hold the same activation, so each sends 1/t of it over the
    (inter-node) pipeline link and the receiving stage all-gathers it over NVLink.
    minipar's pipeline sends the whole tensor from every TP rank (the default)."""
    tokens = config.micro_batch_size * shape.seq_len // config.cp
    if config.sequence_parallel:
        tokens //= config.tp
    nbytes = tokens * shape.d_model * config.bytes.activation
    whole = not scatter_gather or config.tp == 1 or config.sequence_parallel
    gather = 0.0 if whole else cluster.collective_time("all_gather", config.tp, nbytes,
                                                       group_links(config, cluster)["tp"])
    hop = [alpha + (nbytes if whole else nbytes / config.tp) / bandwidth + gather
           for alpha, bandwidth in (cluster.link(False), cluster.link(True))]
    crossing = pipeline_hops_crossing(config, cluster.gpus_per_node)
    return lambda sender, receiver: hop[(sender, receiver) in crossing]


def _last_compute_end(timeline) -> float:
    """When a rank's last compute action of the simulated schedule ends."""
    return max((end for action, _, end in timeline
                if not isinstance(action, P2P_ACTIONS)), default=0.0)


def _pipeline_data_parallel(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                            rank: int, run) -> dict:
    """Pipeline rank `rank`'s DP reduction (plan/overlap.py's pipeline_reduction) from
    when its chunks' last backwards make their gradients in the schedule's simulation
    `run`, and ZeRO-1's parameter all-gathers after the step."""
    if config.replicas == 1 or shape.is_moe:  # (MoE: priced by its transfers)
        return {"overlapped_end_s": 0.0, "after_flush_s": 0.0, "stall_s": 0.0,
                "after_step_s": 0.0, "contention_s": 0.0}
    spec = check_schedule_name(config.schedule)
    p, v = config.pp, config.virtual_stages
    counts = layer_counts(shape.n_layer, p * v, config.layer_split)
    # Timed modules make their gradients through the last backward, from its start;
    # untimed ones (overlap_needs_times: one bucket) all at once, at its end.
    timed = overlap_needs_times(config)
    began = {}  # (chunk, whether an I) -> when its last B, I or W starts making gradients
    split = {}  # chunk -> whether a W (a split backward's second half) ends its backward
    for action, start, end in run.timelines[rank]:
        if isinstance(action, (Backward, BackwardInput, BackwardWeight)):
            began[action.chunk, isinstance(action, BackwardInput)] = start if timed else end
            split[action.chunk] = isinstance(action, BackwardWeight)
    chunks = []
    for c in range(v):
        stage = spec.virtual_stage(p, rank, c)
        plan = StagePlan(rank=rank, chunk_layers=(counts[stage],), first=stage == 0,
                         last=stage == p * v - 1, in_flight=1,
                         tied_copy=shape.tie_embeddings and stage == p * v - 1
                         and spec.virtual_stage(p, rank, 0) != 0)
        modules = stage_modules(shape, config, cluster, plan, split.get(c, False))
        # a checkpointed layer (a chunk's first) makes its weight gradients in its I
        checkpointed = range(int(plan.first), int(plan.first) + checkpointed_layers(config, plan))
        chunks.append(split_back_to_back(stage_modules(shape, config, cluster, plan), modules,
                                         checkpointed, began.get((c, True), 0.0),
                                         began.get((c, False), 0.0))
                      if split.get(c, False) and checkpointed else
                      (back_to_back(modules, began.get((c, False), 0.0)), modules))
    collective = dp_collective(config, cluster)
    whole = stage_plan(shape, config, rank)
    gathers = data_parallel_time(stage_modules(shape, config, cluster, whole), config,
                                 collective)
    computing = [(start, end) for action, start, end in run.timelines[rank]
                 if not isinstance(action, P2P_ACTIONS)]
    reduction = pipeline_reduction(chunks, config, collective, computing)
    hidden = reduction["hidden_s"] + gathers["hidden_gather_s"]
    return {**reduction, "after_step_s": gathers["after_step_s"],
            "contention_s": overlap_contention_seconds(config, cluster, hidden)}


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
        return {**walked_step_time(shape, config, cluster, scatter_gather),
                "simulated_micro_batches": [config.micro_batches]}
    spec = check_schedule_name(config.schedule)
    p, m = config.pp, config.micro_batches
    q = p if spec.micro_batches_multiple_of_pp else 1
    fewest = -(-max(p, spec.min_micro_batches(p)) // q) * q  # the pipeline full, valid
    forward, backward, _ = chunk_costs(shape, config, cluster)
    busiest = max(sum(forward[r]) + sum(backward[r]) for r in range(p))
    for first in (fewest, 2 * fewest, 4 * fewest, 8 * fewest):
        start = first + (m - first) % q  # congruent to m mod q
        apart = q * -(-first // (2 * q))  # half the pipeline's fill, a whole number of q
        counts = [start, start + apart, start + 2 * apart]
        if counts[-1] >= m or sum(compute_actions(config, c) for c in counts) > \
                EXTRAPOLATED_ACTIONS:
            return None
        walks = [walked_step_time(shape, config.replace(grad_accum_steps=c), cluster,
                                  scatter_gather) for c in counts]
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


def walked_step_time(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                     scatter_gather: bool = False) -> dict[str, float]:
    """Step time of a pipelined config from a simulation of its schedule (simulate_step),
    then the step's collectives in the order minipar runs them: the tied embedding's
    all-reduce (first and last rank), the loss broadcast (all ranks), each rank's
    data-parallel reduction and the gradient norm's all-reduces over DP and TP, the
    norm's all-reduce over PP (all ranks again), then the optimizer and ZeRO-1/2's
    parameter all-gather. scatter_gather: see p2p_message_seconds."""
    p = config.pp
    forward, backward, weight = chunk_costs(shape, config, cluster)
    links = group_links(config, cluster)
    message = p2p_message_seconds(shape, config, cluster, scatter_gather)
    schedule = make_schedule(config.schedule, p, config.micro_batches, config.virtual_stages,
                             validated=False)
    # (the weight gradients: what a split backward's W runs, the rest is its B)
    run = simulate_step(schedule, forward, backward, message, weight)  # validates as it times
    clock = list(run.finish)
    pipeline = max(clock)
    tails, data_parallel, tensor_parallel = [], [], []
    for r in range(p):
        plan = stage_plan(shape, config, r)
        transfers = [t for t in stage_traffic(shape, config, plan, cluster.gpus_per_node)
                     if not overlap_priced(t, shape, config)]
        data_parallel.append(_pipeline_data_parallel(shape, config, cluster, r, run))

        def seconds(selected) -> float:
            return sum(t.count * transfer_time(t, cluster, links[t.link]) for t in selected)

        step_transfers = [t for t in transfers
                          if t.phase == "step" or t.label == SEQUENCE_PARALLEL_GRADIENTS]
        tied = seconds(t for t in step_transfers if t.label.startswith("tied"))
        broadcast = seconds(t for t in step_transfers if t.op == "broadcast")
        # DP reduction, then the norm's all-reduces over DP and TP (groups inside the
        # stage), then the one over PP, which waits for every stage.
        reduce = seconds(t for t in step_transfers
                         if t.group != "pp" and t.label != PARAMETER_ALL_GATHER)
        norm = seconds(t for t in step_transfers
                       if t.group == "pp" and t.label == GRADIENT_NORM)
        offload = offload_time(shape, config, cluster, plan)
        optimizer = optimizer_seconds(config, stage_seconds(shape, config, cluster, plan),
                                      offload) - offload["gradient_s"]
        gather = seconds(t for t in step_transfers if t.label == PARAMETER_ALL_GATHER)
        gather += data_parallel[r]["after_step_s"]
        # an offloaded gradient copy is waited for before the norm's all-reduces
        tails.append((tied, broadcast, reduce + offload["gradient_s"], norm,
                      optimizer, gather))
        # the blocking TP transfers, and the ring attention's hops its blocks do not hide
        tensor_parallel.append(seconds(t for t in transfers if t.group == "tp"
                                       and t.phase in ("forward", "backward")
                                       and t.label != SEQUENCE_PARALLEL_GRADIENTS)
                               - config.micro_batches * sum(tp_overlap_hidden(
                                   shape, config, cluster, plan).values())
                               + config.micro_batches * ring_seconds(
                                   shape, config, cluster, plan.chunk_layers))
    # Each rank's communication spans; HTA's exposed communication is their union less
    # its compute (timeline.comm_overlap, what the emulator's report measures): the
    # messages it receives (it waits for them), the ones it sends (they move when the
    # receiver is there, while the sender computes on or idles: the last activation a
    # GPipe stage sends goes out while it waits for its first gradient), then the tail's
    # collectives.
    spans = [[(ended - message(action.peer, r), ended) for action, _, ended in run.timelines[r]
              if isinstance(action, (RecvActivation, RecvGrad))] + run.sent[r]
             for r in range(p)]
    for r in range(p):
        # ZeRO-1's reductions held its compute, and the ones beside it slowed it
        clock[r] += data_parallel[r]["stall_s"] + data_parallel[r]["contention_s"]
    if tails[0][0] > 0:  # first and last rank meet for the tied embedding's all-reduce
        start = max(clock[0], clock[-1])
        clock[0] = clock[-1] = start + tails[0][0]
        spans[0].append((start, clock[0]))
        spans[-1].append((start, clock[-1]))
    start = max(clock)  # the loss broadcast starts with its last member
    # then each rank waits for its DP reduction (started during its last backwards when
    # it overlaps) and reduces what is left, and the DP and TP norms
    for r in range(p):
        dp = data_parallel[r]
        spans[r] += [(start, start + tails[r][1]),
                     (_last_compute_end(run.timelines[r]), dp["overlapped_end_s"])]
        clock[r] = max(start + tails[r][1], dp["overlapped_end_s"])
        spans[r].append((clock[r], clock[r] + dp["after_flush_s"] + tails[r][2]))
        clock[r] += dp["after_flush_s"] + tails[r][2]
    start = max(clock)  # so does the gradient norm's all-reduce over the stages
    clock = [start + tails[r][3] for r in range(p)]
    end = [clock[r] + tails[r][4] + tails[r][5] for r in range(p)]
    computed = [[(began, ended) for action, began, ended in run.timelines[r]
                 if not isinstance(action, P2P_ACTIONS)] for r in range(p)]
    exposed = [tensor_parallel[r]  # (the TP transfers' counts are per step)
               + comm_overlap(computed[r], spans[r])["exposed_comm_s"]
               + tails[r][3] + tails[r][5] for r in range(p)]
    step = max(end)
    # As minipar.distributed.timeline.bubble_fraction: idle share of p ranks x the
    # pipeline's span (a rank that finished early idles until the last one does).
    busy = sum(run.compute) + sum(run.comm)
    total = p * pipeline
    model_flops = shape.model_flops_per_sequence() * config.global_batch_size
    return {
        "step_s": step,
        "rank_end_s": end,  # when each pipeline rank finishes its step
        "rank_exposed_comm_s": exposed,  # communication not hidden by compute, per rank
        # compute each rank lost to the data-parallel reductions it hid
        "rank_contention_s": [dp["contention_s"] for dp in data_parallel],
        "pipeline_s": pipeline,
        "tail_s": step - pipeline,
        "bubble_fraction": 1 - busy / total if total > 0 else 0.0,
        "model_flops": model_flops,
        "mfu": model_flops / (step * config.world_size * cluster.peak_flops),
        "tokens_per_s": config.global_batch_size * shape.seq_len / step,
    }
