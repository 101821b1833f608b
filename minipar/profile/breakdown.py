"""`minipar profile DIR`: read a run's per-rank traces and say where its time and memory went.

    from minipar.profile.breakdown import profile_traces
    from minipar.distributed import read_traces
    prof = profile_traces(read_traces("trace/"))     # written by minipar train --trace trace/
    print(prof.text())                                 # tables and the verdict
    prof.to_dict()                                     # the report's "profile" section

The traces are checked first (minipar.profile.trace_input.check_traces: every value read
here, of the type and range it needs): a malformed one is a TraceFileError naming the
file and the key, not a traceback or a verdict on nonsense. (`minipar profile DIR` reads
the files with minipar.distributed.trace.read_trace_files, as read_traces does, raising
the same TraceFileError.)

Everything comes from the trace files (which come from the ledgers and the simulated
clock), in the definitions Holistic Trace Analysis uses, so HTA reading the same folder
agrees (tests/profile/test_profile_hta.py):
  compute_s          union of the compute kernels          (HTA: compute time)
  exposed_comm_s     communication while nothing computes  (HTA: non-compute time)
  overlapped_comm_s  communication hidden under compute    (HTA: comm-comp overlap x comm)
  idle_s             neither: waiting for a peer, the pipeline bubble (HTA: idle time)
over the run: from 0 to the end of the slowest rank, the same window for every rank, so a
pipeline stage that waits for its first activation counts that wait as bubble. (HTA's window
is a rank's first to last kernel: it leaves out a stage's wait before its first kernel.)

MFU on the simulated device: model FLOPs (the planner's 3 x forward matmuls, no
recomputation; Narayanan et al. 2021 eq. 3) over rank-time x the device's peak FLOP/s.
HFU counts every FLOP executed (recomputation too). On a uniform profile every kernel runs
at the peak, so HFU is the compute share of the window; on a roofline profile (--device
h100 / a100) kernels run below it and HFU is lower than the compute share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minipar.distributed.memory import CATEGORIES
from minipar.distributed.timeline import comm_overlap
from minipar.distributed.trace import COMPUTE_STREAM, peak_flops
from minipar.plan.layout import layer_counts
from minipar.plan.shapes import from_train_config

US = 1e-6  # trace microseconds -> seconds


def _kernels(trace: dict) -> tuple[list[dict], list[dict]]:
    """(compute kernels, communication kernels) of one rank's trace."""
    compute, comm = [], []
    for event in trace["traceEvents"]:
        if event.get("cat") == "kernel":
            (compute if event["args"]["stream"] == COMPUTE_STREAM else comm).append(event)
    return compute, comm


def _span(event: dict) -> tuple[float, float]:
    return event["ts"] * US, (event["ts"] + event["dur"]) * US


def _steps(trace: dict) -> list[tuple[int, float, float]]:
    steps = []
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if event.get("cat") == "user_annotation" and name.startswith("ProfilerStep#"):
            steps.append((int(name.split("#")[1]), event["ts"] * US,
                          (event["ts"] + event["dur"]) * US))
    return sorted(steps)


def rank_breakdown(trace: dict, start: float, end: float) -> dict[str, float]:
    """compute / exposed / overlapped communication / idle seconds of one rank in [start, end]."""
    compute, comm = _kernels(trace)

    def clip(events):
        return [(max(s, start), min(e, end)) for s, e in map(_span, events)]

    overlap = comm_overlap(clip(compute), clip(comm))
    return {"compute_s": overlap["compute_s"], "exposed_comm_s": overlap["exposed_comm_s"],
            "overlapped_comm_s": overlap["overlapped_comm_s"],
            "idle_s": max(0.0, (end - start) - overlap["busy_s"]), "comm_s": overlap["comm_s"]}


def exposed_by_group(trace: dict) -> dict[str, float]:
    """Seconds each group kind's communication runs while nothing computes."""
    compute, comm = _kernels(trace)
    spans = [_span(e) for e in compute]
    groups: dict[str, list] = {}
    for event in comm:
        groups.setdefault(event["args"]["group"], []).append(_span(event))
    return {g: comm_overlap(spans, s)["exposed_comm_s"] for g, s in sorted(groups.items())}


def _during(trace: dict, t: float) -> str:
    """What the rank was doing at simulated time t (the kernel running, or the last one)."""
    compute, comm = _kernels(trace)
    step = next((n for n, s, e in _steps(trace) if s <= t < e), None)
    last = None
    for event in sorted(compute + comm, key=lambda e: e["ts"]):
        if event["ts"] * US > t:
            break
        last = event
    where = "" if step is None else f"step {step}, "
    if last is None:
        return where + "before the first kernel (building the model)"
    args = last["args"]
    if args["stream"] == COMPUTE_STREAM:
        micro = f" of micro-batch {args['micro_batch']}" if "micro_batch" in args else ""
        return where + f"{args['kind']}{micro} ({last['name']})"
    return where + f"{args['op']} over {args['group']} ({last['name']})"


@dataclass
class Profile:
    """What `minipar profile` found; `to_dict()` is the report's "profile" section."""

    world_size: int
    steps: int
    window_s: float
    ranks: list[dict]
    collectives: list[dict]
    memory_peak: dict
    stages: dict | None
    mfu: float
    config: dict
    device: dict
    verdict: dict = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        """Rank-seconds summed over ranks, per kind of time."""
        keys = ("compute_s", "exposed_comm_s", "overlapped_comm_s", "idle_s")
        return {k: sum(r[k] for r in self.ranks) for k in keys}

    def top_collectives(self, key: str, n: int = 5) -> list[dict]:
        return sorted(self.collectives, key=lambda c: -c[key])[:n]

    def to_dict(self) -> dict:
        return {"window_s": self.window_s, "steps": self.steps, "mfu": self.mfu,
                "ranks": self.ranks, "totals": self.totals(),
                "top_collectives_by_time": self.top_collectives("time_s"),
                "top_collectives_by_bytes": self.top_collectives("sent_bytes"),
                "memory_peak": self.memory_peak, "pipeline_stages": self.stages,
                "verdict": self.verdict}

    def text(self) -> str:
        from minipar.profile.verdict import format_profile

        return format_profile(self)


def profile_traces(traces: list[dict], verdict: bool = True, sources=None) -> Profile:
    """The profile of a run from its per-rank traces (`minipar.distributed.read_traces`),
    checked first (`check_traces`; sources: each trace's file, for its messages)."""
    from minipar.profile.trace_input import check_figures, check_traces
    from minipar.train.config import TrainConfig

    given, traces = traces, check_traces(traces, sources)
    files = {} if sources is None else {
        t["distributedInfo"]["rank"]: source for t, source in zip(given, sources, strict=True)}
    folder = Path(sources[0]).parent if sources else "traces"
    meta = traces[0]["minipar"]
    config, device = meta["config"], meta["device"]
    window = max(t["minipar"]["end_s"] for t in traces)
    steps = max(len(_steps(t)) for t in traces)
    shape = from_train_config(TrainConfig.from_saved(config))
    model_flops = shape.model_flops_per_sequence() * config["global_batch_size"] * steps
    executed = []
    for trace in traces:
        compute, _ = _kernels(trace)
        executed.append(sum(e["args"]["flops"] for e in compute))
    peak = peak_flops(device)
    ranks = []
    for trace, flops in zip(traces, executed, strict=True):
        row = {"rank": trace["distributedInfo"]["rank"], "coords": trace["minipar"]["coords"]}
        row.update(rank_breakdown(trace, 0.0, window))
        capacity = window * peak
        # The rank's share of the model FLOPs, in proportion to what it executed.
        share = model_flops * flops / sum(executed) if sum(executed) else 0.0
        row["hfu"] = flops / capacity if capacity else 0.0
        row["mfu"] = share / capacity if capacity else 0.0
        row["exposed_comm_by_group_s"] = exposed_by_group(trace)
        ranks.append(row)
    profile = Profile(
        world_size=len(traces), steps=steps, window_s=window, ranks=ranks,
        collectives=_collectives(traces), memory_peak=_memory_peak(traces),
        stages=_stages(traces, ranks, steps) if config["pp"] > 1 else None,
        mfu=model_flops / (window * len(traces) * peak) if window else 0.0,
        config=config, device=device)
    check_figures(profile, files, folder)  # before the planner is asked about them
    if verdict:
        from minipar.profile.verdict import diagnose

        profile.verdict = diagnose(profile)
        check_figures(profile, files, folder)
    return profile


def _collectives(traces: list[dict]) -> list[dict]:
    """Per (op, group kind): calls, kernel seconds and bytes sent, summed over ranks."""
    table: dict[tuple[str, str], dict] = {}
    for trace in traces:
        _, comm = _kernels(trace)
        for event in comm:
            args = event["args"]
            row = table.setdefault((args["op"], args["group"]), {
                "op": args["op"], "group": args["group"], "kernel": event["name"],
                "calls": 0, "time_s": 0.0, "sent_bytes": 0})
            row["calls"] += 1
            row["time_s"] += event["dur"] * US
            row["sent_bytes"] += args["sent_bytes"]
    return list(table.values())


def _memory_peak(traces: list[dict]) -> dict:
    """The fullest rank's peak: bytes, its largest category, when and during what."""
    best = max(traces, key=lambda t: t["minipar"]["memory_peak"]["bytes"])
    peak = dict(best["minipar"]["memory_peak"])
    by_category = peak["by_category"]
    largest = max(CATEGORIES, key=lambda c: by_category[c])
    return {**peak, "rank": best["distributedInfo"]["rank"], "largest_category": largest,
            "largest_share": by_category[largest] / peak["bytes"] if peak["bytes"] else 0.0,
            "during": _during(best, peak["at_s"])}


def _stages(traces: list[dict], ranks: list[dict], steps: int) -> dict:
    """Compute seconds per optimizer step of each pipeline stage (mean over its ranks)."""
    by_stage: dict[int, list[float]] = {}
    for row in ranks:
        by_stage.setdefault(row["coords"]["pp"], []).append(row["compute_s"])
    compute = [sum(v) / len(v) / max(steps, 1) for _, v in sorted(by_stage.items())]
    mean = sum(compute) / len(compute)
    slowest = max(range(len(compute)), key=lambda i: compute[i])
    config = traces[0]["minipar"]["config"]
    layers = layer_counts(config["n_layer"], config["pp"] * config["virtual_stages"])
    return {"compute_per_step_s": compute, "slowest_stage": slowest,
            "imbalance": compute[slowest] / mean - 1 if mean else 0.0,
            "layers_per_chunk": layers}
