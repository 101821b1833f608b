"""A pipelined step, exactly: the schedule simulated over every (rank, chunk)'s costs,
then the step's tail in the order minipar runs it.

`chunk_costs` prices one micro-batch's forward and backward of each model chunk on its
pipeline rank (compute on the roofline, the TP collectives and ZeRO-3 gathers it waits
for, a ring's exposed hops: timing.py's per-micro-batch model); the schedule registry's
simulator (minipar.parallel.pipeline.simulator.simulate_step, the one the trainer's
schedules are validated with) walks the schedule's actions over them with a message
cost per hop (`p2p_message_seconds`); `walked_step_time` adds the tail: the tied
embedding's and the loss's collectives, each rank's data-parallel reduction (hidden as
far as overlap.py says), the gradient norm's all-reduces and the optimizer. The closed
form for uniform stages (timing.step_time) is what this reduces to when stages are
equal and messages free.

How far it walks (a long step is extrapolated from short walks):
pipeline_extrapolation.py.
"""

from __future__ import annotations

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
from minipar.plan.cluster import ClusterSpec, Link
from minipar.plan.layout import (
    ParallelConfig,
    StagePlan,
    checkpointed_layers,
    layer_counts,
    stage_plan,
)
from minipar.plan.offload import offload_time
from minipar.plan.overlap import data_parallel_time, pipeline_reduction
from minipar.plan.placement import replica_hops_crossing
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
    pipeline_message_bytes,
    stage_traffic,
)

P2P_ACTIONS = (SendActivation, SendGrad, RecvActivation, RecvGrad)
# Distinct replica placements walked one by one (placement.replica_hops_crossing); more
# (pp 31 x dp 32 on 32-GPU nodes has 32) are walked as one, crossing wherever any does:
# each walk is a whole simulation, and the plan must answer in seconds.
MAX_REPLICA_WALKS = 4


def chunk_costs(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec
                ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Seconds of one micro-batch's forward and backward of every (rank, chunk), with the
    tensor-parallel collectives and ZeRO-3 gathers it waits for; and of each backward
    the weight gradients' compute (the W a zero-bubble schedule runs apart)."""
    p, v, m = config.pp, config.virtual_stages, config.micro_batches
    counts = layer_counts(shape.n_layer, p * v, config.layer_split)
    spec = check_schedule_name(config.schedule)
    forward = [[0.0] * v for _ in range(p)]
    backward = [[0.0] * v for _ in range(p)]
    weight = [[0.0] * v for _ in range(p)]
    for r in range(p):
        links = group_links(config, cluster, r)  # (a stage's own data-parallel links)
        for c in range(v):
            stage = spec.virtual_stage(p, r, c)  # the schedule's placement (c p + r, or a V)
            chunk = StagePlan(rank=r, chunk_layers=(counts[stage],), first=stage == 0,
                              last=stage == p * v - 1, tied_copy=False, in_flight=1,
                              chunk_starts=(sum(counts[:stage]),))
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
                        scatter_gather: bool, hops: frozenset):
    """`seconds(sender, receiver)` of one pipeline message, a micro-batch's (b, s, h)
    activation or its gradient, between two neighbouring pipeline ranks: over the network
    on a hop between nodes (in `hops`: placement.replica_hops_crossing), else over NVLink.

    scatter_gather: Megatron-LM's optimisation of pipeline messages across tensor
    parallelism (Narayanan et al. 2021, section 4.1; megatron/p2p_communication.py): the
    t ranks of a stage hold the same activation, so each sends 1/t of it over the
    (inter-node) pipeline link and the receiving stage all-gathers it over NVLink.
    minipar's pipeline sends the whole tensor from every TP rank (the default)."""
    nbytes = pipeline_message_bytes(shape, config)
    whole = not scatter_gather or config.tp == 1 or config.sequence_parallel
    gather = 0.0 if whole else cluster.collective_time("all_gather", config.tp, nbytes,
                                                       group_links(config, cluster)["tp"])
    hop = [alpha + (nbytes if whole else nbytes / config.tp) / bandwidth + gather
           for alpha, bandwidth in (cluster.link(False), cluster.link(True))]
    return lambda sender, receiver: hop[(sender, receiver) in hops]


def _last_compute_end(timeline) -> float:
    """When a rank's last compute action of the simulated schedule ends."""
    return max((end for action, _, end in timeline
                if not isinstance(action, P2P_ACTIONS)), default=0.0)


def _gradients_made(config: ParallelConfig, runs, rank: int) -> tuple[dict, dict]:
    """(began, split) of pipeline rank `rank`: when each chunk's last B, I or W starts
    making its gradients ((chunk, whether an I) -> seconds), the latest over the
    replicas' simulations `runs` (a bucket's collective starts with its last member);
    and whether a W (a split backward's second half) ends each chunk's backward. Timed
    modules make their gradients through the last backward, from its start; untimed
    ones (overlap_needs_times: one bucket) all at once, at its end."""
    timed = overlap_needs_times(config)
    began, split = {}, {}
    for action, start, end in (event for run in runs for event in run.timelines[rank]):
        if isinstance(action, (Backward, BackwardInput, BackwardWeight)):
            key = action.chunk, isinstance(action, BackwardInput)
            began[key] = max(began.get(key, 0.0), start if timed else end)
            split[action.chunk] = isinstance(action, BackwardWeight)
    return began, split


def _pipeline_data_parallel(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                            rank: int, run, made: tuple[dict, dict], held: bool = False
                            ) -> dict:
    """Pipeline rank `rank`'s DP reduction (plan/overlap.py's pipeline_reduction) from
    when its chunks' last backwards make their gradients (`made`: _gradients_made) in
    the schedule's simulation `run`, and ZeRO-1's parameter all-gathers after the
    step. held: `run` holds the rank where ZeRO-1's reductions in flight stall it."""
    if config.replicas == 1 or shape.is_moe:  # (MoE: priced by its transfers)
        return {"overlapped_end_s": 0.0, "busy": [], "after_flush_s": 0.0, "stall_s": 0.0,
                "stalls": [], "after_step_s": 0.0, "contention_s": 0.0}
    spec = check_schedule_name(config.schedule)
    p, v = config.pp, config.virtual_stages
    counts = layer_counts(shape.n_layer, p * v, config.layer_split)
    began, split = made
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
    collective = dp_collective(config, cluster, rank)
    whole = stage_plan(shape, config, rank)
    gathers = data_parallel_time(stage_modules(shape, config, cluster, whole), config,
                                 collective)
    computing = [(start, end) for action, start, end in run.timelines[rank]
                 if not isinstance(action, P2P_ACTIONS)]
    reduction = pipeline_reduction(chunks, config, collective, computing, held)
    hidden = reduction["hidden_s"] + gathers["hidden_gather_s"]
    return {**reduction, "after_step_s": gathers["after_step_s"],
            "contention_s": overlap_contention_seconds(config, cluster, hidden)}


def walked_step_time(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                     scatter_gather: bool = False) -> dict[str, float]:
    """Step time of a pipelined config from a simulation of its schedule (simulate_step),
    then the step's collectives in the order minipar runs them: the tied embedding's
    all-reduce (first and last rank), the loss broadcast (all ranks), each rank's
    data-parallel reduction and the gradient norm's all-reduces over DP and TP, the
    norm's all-reduce over PP (all ranks again), then the optimizer and ZeRO-1/2's
    parameter all-gather. scatter_gather: see p2p_message_seconds. Replicas whose
    pipelines cross nodes on different hops (placement.replica_hops_crossing) are walked
    each: the step is the slowest one's, a rank's exposed communication its busiest's."""
    forward, backward, weight = chunk_costs(shape, config, cluster)
    schedule = make_schedule(config.schedule, config.pp, config.micro_batches,
                             config.virtual_stages, validated=False)
    patterns = replica_hops_crossing(config, cluster.gpus_per_node)
    if len(patterns) > MAX_REPLICA_WALKS:  # walked as one: every hop that any crosses
        patterns = (frozenset().union(*patterns),)
    messages = [p2p_message_seconds(shape, config, cluster, scatter_gather, hops)
                for hops in patterns]
    # each replica's schedule, validated as it is timed (`weight`: what a split backward's
    # W runs, the rest is its B); then again with the waits ZeRO-1's limit of reductions
    # in flight puts in its backwards, which delay what they send and so the pipeline
    runs = [simulate_step(schedule, forward, backward, message, weight) for message in messages]
    made = [_gradients_made(config, runs, r) for r in range(config.pp)]
    holds = [_stall_holds(shape, config, cluster, run, made) for run in runs]
    if any(holds):
        runs = [simulate_step(schedule, forward, backward, message, weight, hold)
                for message, hold in zip(messages, holds, strict=True)]
        made = [_gradients_made(config, runs, r) for r in range(config.pp)]
    walks = [_walked(shape, config, cluster, run, made, message, hops, any(holds))
             for run, message, hops in zip(runs, messages, patterns, strict=True)]
    exposed = [max(column) for column in zip(*(w["rank_exposed_comm_s"] for w in walks),
                                             strict=True)]
    return {**max(walks, key=lambda walk: walk["step_s"]), "rank_exposed_comm_s": exposed}


def _stall_holds(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec, run,
                 made: list) -> dict[tuple[int, int], float]:
    """{(rank, i): seconds} ZeRO-1's limit of reductions in flight stalls each rank of the
    simulation `run` after its i-th action (simulate_step's hold): at the nearer end of
    the compute action running when the wait came (the schedule times an action whole).
    Empty without a limit (Megatron-LM's distributed optimizer, DDP): nothing to hold."""
    holds: dict[tuple[int, int], float] = {}
    if (config.zero == 0 or config.reductions_in_flight is None
            or not config.overlap_grad_reduce):
        return holds
    for r in range(config.pp):
        for when, seconds in _pipeline_data_parallel(shape, config, cluster, r, run,
                                                     made[r])["stalls"]:
            i, start, end = max((i, start, end) for i, (action, start, end)
                                in enumerate(run.timelines[r])
                                if not isinstance(action, P2P_ACTIONS) and start <= when)
            holds[r, i] = holds.get((r, i), 0.0) + seconds
    return holds


def _walked(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec, run, made,
            message, hops: frozenset, held: bool = False) -> dict[str, float]:
    """walked_step_time of the replicas whose schedule ran as `run` (`made`: when each
    rank's gradients are made, _gradients_made; `held`: where ZeRO-1 stalls them),
    their pipeline messages priced by `message`: those that cross nodes on `hops`, and
    whose pipeline group's collectives stay inside one node when none does."""
    p = config.pp
    clock = list(run.finish)
    pipeline = max(clock)
    tails, data_parallel, tensor_parallel = [], [], []
    for r in range(p):
        plan = stage_plan(shape, config, r)
        transfers = [t for t in stage_traffic(shape, config, plan, cluster.gpus_per_node)
                     if not overlap_priced(t, shape, config)]
        data_parallel.append(_pipeline_data_parallel(shape, config, cluster, r, run,
                                                     made[r], held))
        links = {**group_links(config, cluster, r), **({} if hops else {"pp": Link(0, 1)})}

        def seconds(selected, links=links) -> float:
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
        # an offloaded gradient copy (PCIe, not the network) is waited for before the
        # norm's all-reduces
        tails.append((tied, broadcast, reduce, norm, optimizer, gather, offload["gradient_s"]))
        # the blocking TP and EP transfers (an MoE layer's all-to-alls), and the ring
        # attention's hops its blocks do not hide
        tensor_parallel.append(seconds(t for t in transfers if t.group in ("tp", "ep")
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
        # its reductions as its stream ran them (a replica ahead of the others waits for
        # its group idle: a collective starts with its last member); shifted by ZeRO's
        # stalls, the stream's clock is not the schedule's, so then what is left of them
        # after the rank's last compute
        spans[r] += [(start, start + tails[r][1]), *(dp["busy"] if not dp["stall_s"] else [
            (_last_compute_end(run.timelines[r]), dp["overlapped_end_s"])])]
        clock[r] = max(start + tails[r][1], dp["overlapped_end_s"])
        spans[r].append((clock[r], clock[r] + dp["after_flush_s"] + tails[r][2]))
        clock[r] += dp["after_flush_s"] + tails[r][2] + tails[r][6]
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
