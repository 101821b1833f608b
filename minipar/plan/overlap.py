"""Communication hidden behind compute: bucketed gradient reduction and ZeRO-3 prefetch.

The one home of the planner's overlap model (timing.py feeds it module times and uses
what it returns). A rank's data-parallel communication runs on its group's stream
(one NCCL communicator: collectives of a group run one after another) while its compute
stream goes on; what the step pays is the *exposed* part, the time the rank waits for a
transfer while it computes nothing (Holistic Trace Analysis's definition, as
minipar.distributed.timeline.comm_overlap measures it), and, on a real GPU, what the
hidden part slows the compute beside it (`hidden_s` here; timing.overlap_contention_seconds
prices it, 0 on the emulator's clusters, whose streams share nothing).

Gradient buckets (Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3; DeepSpeed's
`overlap_comm` / `reduce_bucket_size`; Megatron-LM's `--overlap-grad-reduce`), laid out by
plan/buckets.py: bucket k is complete when backward has finished the module holding its
last parameter, at r_k; its reduction of d_k seconds starts when both the
bucket and the stream are free:

    start_k = max(r_k, end_(k-1)),   end_k = start_k + d_k,
    exposed = max(0, end_K - T_backward)

so what outlasts the backward is about the last bucket (it is ready only when backward
ends) plus whatever the reductions exceed the compute left behind them. DeepSpeed's
ZeRO-1/2 (its double-buffered IPG bucket under overlap_comm, deepspeed/runtime/zero/
stage_1_and_2.py; minipar.parallel.zero.sharded.MAX_IN_FLIGHT) keeps at most two
reductions in flight: launching a third first waits for the oldest, which stalls the
compute stream too. Megatron-LM's distributed optimizer has no such limit (megatron/core/
distributed/param_and_grad_buffer.py launches each bucket's reduce-scatter as it is
ready): ParallelConfig.reductions_in_flight says whose. Without overlap
(`--no-overlap-grad-reduce`) every bucket is waited for as it starts: exposed =
sum_k d_k, the upper bound the planner used to price.
DDP and ZeRO-1 reduce only in the step's last micro-batch (`no_sync`); ZeRO-2 and -3 in
every micro-batch's backward. Under pipeline parallelism the same recurrence runs in
each chunk's last micro-batch backward (Megatron's `enable_grad_sync()` before it), and
the tied embedding's bucket waits until its copies are summed after the flush.

ZeRO-3 prefetch (PyTorch FSDP's `forward_prefetch` / `backward_prefetch=BACKWARD_PRE`;
DeepSpeed's `stage3_prefetch_bucket_size`): as a module starts, the all-gather of the
next one (forward order in forward, reverse in backward) is launched, so it runs while
the current one computes and the next gather finds it done or waits for what is left.
Without prefetch each gather blocks (`--no-zero3-prefetch`). Under full recomputation a
unit's backward starts with its forward again, and the prefetch waits for that forward's
output. Two of ZeRO-3's variants across nodes keep its order and run the same recurrence:
FSDP2's reshard_after_forward=False keeps each unit gathered from its forward to its
backward; HSDP runs it over its shard group, and its last micro-batch waits for each
unit's all-reduce over the replicas as it waits for the unit's reduce-scatter.

Module times are the planner's compute and blocking tensor-parallel communication of
each module (timing.stage_modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, lru_cache, partial

from minipar.parallel.zero.sharded import MAX_IN_FLIGHT
from minipar.plan.buckets import GradientBucket, Module, alike, gradient_buckets
from minipar.plan.layout import ParallelConfig
from minipar.plan.memory import shard


# ------------------------------------------------------------------ the recurrences
@dataclass
class Stream:
    """A group's communication stream: when it is free again, and when it was busy."""

    free_at: float = 0.0
    busy: list[tuple[float, float]] = field(default_factory=list)

    def launch(self, now: float, seconds: float) -> float:
        """Post a collective at `now`; it runs when the stream is free. Returns its end."""
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.busy.append((start, self.free_at))
        return self.free_at


def overlap_seconds(spans: list[tuple[float, float]],
                    computing: list[tuple[float, float]]) -> float:
    """Seconds of `spans` (a stream's collectives, one after another) that fall inside
    `computing` (the rank's compute actions, disjoint): a sweep over both, in order."""
    total, j, computing = 0.0, 0, sorted(computing)
    for start, end in sorted(spans):
        while j < len(computing) and computing[j][1] <= start:
            j += 1
        k = j
        while k < len(computing) and computing[k][0] < end:
            total += min(end, computing[k][1]) - max(start, computing[k][0])
            k += 1
    return total


def reduce_during_backward(backward_s: float, buckets: list[GradientBucket],
                           durations: list[float], overlap: bool,
                           max_in_flight: int | None, stream: Stream | None = None,
                           start: float = 0.0, stalls: list | None = None
                           ) -> tuple[float, float]:
    """(when the compute stream has finished one backward of `backward_s` compute
    seconds begun at `start`, stalls included; when its last reduction ends): the
    recurrence above. The rank waits for both at the end of backward.

    buckets[k] is complete after buckets[k].after_s of that compute and is reduced in
    durations[k] seconds on `stream`; overlap False: each reduction is waited for as it
    starts; max_in_flight: at most that many reductions pending (ZeRO), None: no limit
    (DDP). Late buckets are skipped (the caller reduces them after the flush). stalls: a
    list to append each wait of the compute stream to, as (when in its compute, without
    the waits before it, seconds)."""
    stream = Stream() if stream is None else stream
    clock, done, pending = start, 0.0, []
    for bucket, seconds in zip(buckets, durations, strict=True):
        if bucket.late:
            continue
        clock += bucket.after_s - done  # compute until the bucket is complete
        done = bucket.after_s
        if max_in_flight is not None and len(pending) == max_in_flight:
            ready = pending.pop(0)  # the compute stream waits too
            if stalls is not None and ready > clock:
                stalls.append((start + bucket.after_s, ready - clock))
            clock = max(clock, ready)
        end = stream.launch(clock, seconds)
        if overlap:
            pending.append(end)
        else:
            clock = end
    clock += backward_s - done
    return clock, max(pending, default=clock)


def zero3_micro_batch(modules: list[Module], gather_s: list[float],
                      reduce_s: list[float], prefetch: bool, overlap: bool,
                      tied_head: bool, keep_after_forward: bool = False,
                      all_reduce_s: list[float] | None = None
                      ) -> tuple[float, float, float]:
    """(seconds, communication seconds, of which beside compute) of one micro-batch's
    forward and backward under ZeRO-3, the gathers, prefetches and reduce-scatters on
    one stream (zero3.py's hooks).

    modules in forward order, gather_s / reduce_s: each module's unit all-gather and
    reduce-scatter; the head's call gathers the embedding unit too when it is tied;
    keep_after_forward: FSDP2's reshard_after_forward=False (zero/reshard.py), a unit
    stays gathered from its forward to its backward, which then gathers nothing;
    all_reduce_s: HSDP's last micro-batch (zero/hybrid.py), each unit's gradient shard
    all-reduced over its replicas as its reduce-scatter is waited for, blocking.

    A search prices the same chunk again under other settings, and a chunk is thousands
    of alike layers: its micro-batch is simulated once per distinct run of modules and
    times (`_runs`)."""
    if not modules:
        return 0.0, 0.0, 0.0
    rows = zip(modules, gather_s, reduce_s,
               [None] * len(modules) if all_reduce_s is None else all_reduce_s, strict=True)
    return _zero3_simulated(_runs(rows), prefetch, overlap, tied_head, keep_after_forward,
                            all_reduce_s is not None)


def _runs(items) -> tuple[tuple[object, int], ...]:
    """(item, how many times in a row) of a sequence."""
    runs: list[list] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1][1] += 1
        else:
            runs.append([item, 1])
    return tuple((item, count) for item, count in runs)


@lru_cache(maxsize=512)
def _zero3_simulated(runs: tuple[tuple[tuple, int], ...], prefetch: bool, overlap: bool,
                     tied_head: bool, keep_after_forward: bool, replicas: bool
                     ) -> tuple[float, float, float]:
    """zero3_micro_batch of the modules and times that `runs` lists."""
    modules, gather_s, reduce_s, all_reduce_s = (
        list(column) for column in zip(*(row for row, count in runs for _ in range(count)),
                                       strict=True))
    all_reduce_s = all_reduce_s if replicas else None
    n = len(modules)
    sites = [(j,) for j in range(n)]  # the units each module's call gathers
    if tied_head and n > 1 and modules[0].name == "embedding":
        sites[-1] = (n - 1, 0)
    stream, clock, comm = Stream(), 0.0, 0.0
    computing: list[tuple[float, float]] = []  # the compute stream's spans

    def compute(seconds: float) -> None:
        nonlocal clock
        computing.append((clock, clock + seconds))
        clock += seconds

    gathered = [False] * n
    arrives: list[float | None] = [None] * n  # a prefetched unit's gather ends then

    def gather(units: tuple[int, ...]) -> None:
        nonlocal clock, comm
        for u in units:
            if gathered[u]:
                continue
            if arrives[u] is not None:
                clock = max(clock, arrives[u])
                arrives[u] = None
            else:  # a blocking all-gather
                clock = stream.launch(clock, gather_s[u])
                comm += gather_s[u]
            gathered[u] = True

    def prefetch_site(i: int) -> None:
        nonlocal comm
        if not prefetch or not 0 <= i < n:
            return
        for u in sites[i]:
            if not gathered[u] and arrives[u] is None:
                arrives[u] = stream.launch(clock, gather_s[u])
                comm += gather_s[u]

    for i, units in enumerate(sites):  # forward: gather, prefetch the next, compute, free
        gather(units)
        prefetch_site(i + 1)
        compute(modules[i].forward_s)
        for u in units:
            gathered[u] = keep_after_forward
    pending: list[tuple[float, int]] = []  # (a reduce-scatter's end, its unit)

    def complete(end: float, unit: int) -> None:
        nonlocal clock, comm
        clock = max(clock, end)
        if all_reduce_s is not None:
            clock += all_reduce_s[unit]
            comm += all_reduce_s[unit]

    for i in reversed(range(n)):  # backward
        gather(sites[i])
        # a recomputed module's forward runs first; the hook that prefetches the next
        # unit is on its (recomputed) output, so the prefetch starts after it
        compute(modules[i].recompute_s)
        prefetch_site(i - 1)
        compute(modules[i].backward_s - modules[i].recompute_s)
        if len(pending) == MAX_IN_FLIGHT:
            complete(*pending.pop(0))
        end = stream.launch(clock, reduce_s[i])
        comm += reduce_s[i]
        if overlap:
            pending.append((end, i))
        else:
            complete(end, i)
        gathered[i] = False
    for end, unit in pending:
        complete(end, unit)
    # beside compute: not while the rank waits (for a gather, or HSDP's blocking
    # all-reduce, during which the shard group's stream may still be busy)
    return clock, comm, overlap_seconds(stream.busy, computing)


# ------------------------------------------------------------------ one rank's step
def data_parallel_time(modules: list[Module], config: ParallelConfig, collective,
                       tied_head: bool = True) -> dict:
    """Seconds of a rank's data-parallel gradient reduction and parameter gathers per
    step, for a chunk of `modules` (forward order) and `collective(op, nbytes, group)`
    -> the alpha-beta time over that group ("dp", or HSDP's "dp_shard" and
    "dp_replicate"); tied_head: the head reads the embedding's weight (ZeRO-3
    gathers that unit again for it). Returns

      per_micro_batch_s  ZeRO-2/3: what every micro-batch's forward and backward wait
                         for (exposed), beyond their compute
      last_backward_s    DDP / ZeRO-1: what the last backward waits for (exposed);
                         HSDP: what its all-reduces over the replicas add to it
      late_s             buckets reduced after the flush (tied embedding copies)
      after_step_s       ZeRO-1/2: the parameter all-gathers after the optimizer
      comm_s             every one of these transfers' time, hidden or not, per step
      hidden_s           the part of comm_s that ran beside compute (none of the above)
      hidden_gather_s    of which ZeRO-1/2's parameter all-gathers
      buckets            how many gradient buckets
    """
    zero, m = config.zero, config.micro_batches
    b = config.bytes
    collective = cache(collective)  # thousands of alike layers' buckets, priced once
    out = dict(per_micro_batch_s=0.0, last_backward_s=0.0, late_s=0.0, after_step_s=0.0,
               comm_s=0.0, hidden_s=0.0, hidden_gather_s=0.0, buckets=0)
    if config.replicas == 1 or not modules:
        return out
    overlap = config.overlap_grad_reduce
    compute = sum(mod.backward_s for mod in modules)
    if zero == 3:
        out["buckets"] = sum(1 for mod in modules if mod.tensors)  # a bucket per unit
        n, group = config.sharding_group, "dp_shard" if config.hsdp_shard_size else "dp"
        forward_units = alike(modules, lambda mod: shard(sum(mod.tensors), n) * n)
        gather_s = [collective("all_gather", u * b.param, group) for u in forward_units]
        reduce_s = [collective("reduce_scatter", u * b.grad, group) for u in forward_units]
        micro_batch = partial(zero3_micro_batch, modules, gather_s, reduce_s,
                              config.zero3_prefetch, overlap,
                              tied_head=tied_head and any(mod.name == "head"
                                                          for mod in modules),
                              keep_after_forward=config.reshard_after_forward is False)
        seconds, comm, hidden = micro_batch()
        last, last_comm, last_hidden = seconds, comm, hidden
        if config.replicas > n:  # HSDP: the last micro-batch all-reduces over replicas
            last, last_comm, last_hidden = micro_batch(all_reduce_s=[
                collective("all_reduce", u // n * b.grad, "dp_replicate")
                for u in forward_units])
        out["per_micro_batch_s"] = seconds - compute - sum(mod.forward_s for mod in modules)
        out["last_backward_s"] = last - seconds
        out["comm_s"] = m * comm + last_comm - comm
        out["hidden_s"] = (m - 1) * hidden + last_hidden
        return out
    buckets = gradient_buckets(modules, config)
    out["buckets"] = len(buckets)
    op = "all_reduce" if zero == 0 else "reduce_scatter"
    durations = [collective(op, bucket.numel * b.grad) for bucket in buckets]
    limit = None if zero == 0 else config.reductions_in_flight
    exposed = max(reduce_during_backward(compute, buckets, durations, overlap, limit)) - compute
    out["late_s"] = sum(d for d, bucket in zip(durations, buckets, strict=True) if bucket.late)
    reductions = m if zero == 2 else 1
    if zero == 2:
        out["per_micro_batch_s"] = exposed
    else:
        out["last_backward_s"] = exposed
    out["comm_s"] = reductions * sum(durations)
    if zero in (1, 2):
        gathers = [collective("all_gather", bucket.numel * b.param) for bucket in buckets]
        out["after_step_s"] = sum(gathers)
        if config.overlap_param_gather:
            out["after_step_s"] = param_gather_exposed(gathers, modules)
        out["comm_s"] += sum(gathers)
        out["hidden_gather_s"] = sum(gathers) - out["after_step_s"]
    exposed = (m * out["per_micro_batch_s"] + out["last_backward_s"] + out["late_s"]
               + out["after_step_s"])
    out["hidden_s"] = max(0.0, out["comm_s"] - exposed)
    return out


def param_gather_exposed(gathers: list[float], modules: list[Module]) -> float:
    """Seconds of the distributed optimizer's parameter all-gathers the next step waits
    for with Megatron-LM's --overlap-param-gather (megatron/core/distributed/
    param_and_grad_buffer.py: each bucket's all-gather is launched after the step and
    waited for by a forward pre-hook of its first module): the first bucket's gather
    (forward order: the last one backward reduced) before the first forward can start,
    and what of the rest outlasts one micro-batch's forward."""
    if not gathers:
        return 0.0
    forward = sum(mod.forward_s for mod in modules)
    return max(gathers[-1], sum(gathers) - forward)


def pipeline_reduction(chunks: list[tuple[list[float], list[Module]]], config: ParallelConfig,
                       collective, computing: list[tuple[float, float]] | None = None,
                       held: bool = False) -> dict:
    """A pipeline rank's DP reduction (ZeRO-0/1), from the schedule's simulation.

    chunks: (when each module's backward begins in the chunk's last micro-batch
    (buckets.back_to_back from that backward's start, or a split backward's I and W
    apart), its modules in forward order), in the rank's registration order. The rank's
    buckets are built over all its chunks (minipar.parallel.data.buckets.build_buckets
    over the rank's parameters), so one may straddle two chunks. With overlap each
    bucket is reduced as soon as the chunk backward that makes its last gradient has
    (Megatron's --overlap-grad-reduce: sync on in each chunk's last micro-batch), on one
    stream, the late ones (a tied embedding) after the flush; without overlap, all of
    them after the flush. Returns
      overlapped_end_s  when the reductions started during the last backwards end
      busy              the (start, end) of each of them on the group's stream
      after_flush_s     seconds of reduction left for after the flush
      stall_s           how long ZeRO-1's limit of reductions in flight
                        (config.reductions_in_flight) held the compute stream; 0 when
                        `held`: the schedule was simulated with those waits in it
      stalls            each of those waits, as (when, without the waits before it;
                        seconds)
      hidden_s          seconds of reduction that ran beside compute: beside the rank's
                        compute actions `computing` (the schedule's (start, end) of each,
                        as the simulation ran them), or without them beside anything
                        before the last backward ends (an upper bound: a wait between
                        two chunks' backwards counts as compute)"""
    op = "all_reduce" if config.zero == 0 else "reduce_scatter"
    collective = cache(collective)  # thousands of alike layers' buckets, priced once
    # The rank's own buckets, each launched when its last parameter's gradient is made,
    # in whichever chunk's last backward that is (one straddling two chunks waits for
    # the later one); on one clock through the chunks' last backwards.
    every = [mod for _, modules in chunks for mod in modules]
    begins = [b for starts, _ in chunks for b in starts]
    buckets = sorted(gradient_buckets(every, config, begins), key=lambda b: b.after_s)
    durations = [collective(op, bucket.numel * config.bytes.grad) for bucket in buckets]
    if not config.overlap_grad_reduce:
        return {"overlapped_end_s": 0.0, "busy": [], "after_flush_s": sum(durations),
                "stall_s": 0.0, "stalls": [], "hidden_s": 0.0}
    stream = Stream()
    end = max((b + mod.backward_s for b, mod in zip(begins, every, strict=True)),
              default=0.0)
    stalls: list[tuple[float, float]] = []
    computed, _ = reduce_during_backward(end, buckets, durations, True,
                                         None if config.zero == 0 or held
                                         else config.reductions_in_flight, stream,
                                         stalls=stalls)
    stall = computed - end
    after = sum(d for d, b in zip(durations, buckets, strict=True) if b.late)
    if computing is None:
        hidden = max(0.0, sum(durations) - after - max(0.0, stream.free_at - computed) - stall)
    else:
        hidden = overlap_seconds(stream.busy, computing)
    return {"overlapped_end_s": stream.free_at, "busy": stream.busy, "after_flush_s": after,
            "stall_s": stall, "stalls": stalls, "hidden_s": hidden}
