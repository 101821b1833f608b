"""Profiler traces of a run: one Chrome Trace Event JSON file per rank, on the simulated clock.

    results, devices = dist.launch(fn, 8, return_devices=True, trace=True)
    dist.write_traces("trace/", devices)          # trace/rank0.json ... rank7.json
    # open trace/merged/all_ranks.json in https://ui.perfetto.dev (every rank, p2p arrows),
    # or read trace/ with Holistic Trace Analysis: TraceAnalysis(trace_dir="trace/")

What `torch.profiler`'s `export_chrome_trace` writes per rank of a distributed job, in the
Trace Event Format (Google, "Trace Event Format", 2016; timestamps in microseconds), and in
the conventions Holistic Trace Analysis (HTA 0.5.0, hta/common/trace_parser.py and
hta/utils/utils.py) uses to tell GPU work apart:
  - every GPU kernel is a complete event ("ph": "X") with "cat": "kernel" and `args`
    {"stream", "device", "correlation"}; compute kernels run on stream 7 (what CUDA's default
    stream shows as in PyTorch traces), each group's communication on its own stream, so
    slices on one thread nest and overlap is visible;
  - a communication kernel's name starts with "nccl" and contains "Kernel"
    (HTA: `^nccl.*Kernel`): ncclDevKernel_AllReduce_RING, ncclDevKernel_SendRecv, ...;
  - each kernel has a host-side "cudaLaunchKernel" (cat "cuda_runtime") with the same
    correlation id: HTA keeps only the kernels launched inside a ProfilerStep;
  - "ProfilerStep#N" annotations (cat "user_annotation") on the host thread mark the steps;
  - "distributedInfo" {"rank", "world_size"} and "deviceProperties" head the file.
Besides: flow events ("ph": "s" / "f") from every send to its recv, memory counters
("ph": "C", one series per ledger category), and a "minipar" section (config, mesh
coordinates, the simulated GPU) that `minipar profile` reads.

Where this differs from a real GPU trace, on purpose: the host is not simulated, so each
launch sits at its kernel's start (a real CPU runs ahead of its GPU); and a real NCCL
kernel starts when its rank launches it and spins until its peers arrive, while minipar's
starts when the transfer does (the last member arrived): the wait for a peer shows as idle
time, as minipar's report counts it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from minipar.errors import InputFileError, MiniparError
from minipar.files import atomic_write, load_json

from .clock import DeviceProfile
from .memory import CATEGORIES
from .roofline import Roofline

TRACE_SCHEMA = "minipar.trace/1"
HOST_TID = 1  # the rank's Python thread (its host)
COMPUTE_STREAM = 7
# One stream per group kind, as each NCCL communicator has its own; a second transfer of a
# kind that overlaps the first (an isend while an irecv runs) takes the next stream.
COMM_STREAMS = {"tp": 20, "dp": 30, "pp": 40, "other": 50, "cp": 60, "ep": 70,
                "dp_shard": 80, "dp_replicate": 90, "dp_secondary": 100, "dp_intra_node": 110,
                "dp_inter_node": 120}
# NCCL has no all-to-all kernel: torch.distributed.all_to_all runs grouped send/recv
# pairs, whose kernel is ncclDevKernel_SendRecv (what a real MoE trace shows).
NCCL_NAMES = {"all_reduce": "AllReduce", "all_gather": "AllGather",
              "reduce_scatter": "ReduceScatter", "broadcast": "Broadcast", "reduce": "Reduce",
              "barrier": "AllReduce", "send": "SendRecv", "recv": "SendRecv",
              "all_to_all": "SendRecv"}
US = 1e6  # simulated seconds -> trace microseconds


class TraceRecorder:
    """What a traced rank keeps besides its summaries: every compute span, one per op
    (the clock's timeline merges back-to-back ops of a kind into one bar)."""

    __slots__ = ("kernels",)

    def __init__(self) -> None:
        self.kernels: list[tuple[str, str, str, float, float, float]] = []

    def kernel(self, kind: str, op: str, label: str, start: float, end: float,
               flops: float) -> None:
        """kind: forward | backward | optimizer; label: the micro-batch ("F3") or ""."""
        self.kernels.append((kind, op, label, start, end, flops))


def algorithm(op: str) -> str:
    """How minipar moves the bytes of `op` (collectives.py): NCCL's name for it."""
    if op in ("send", "recv"):
        return "p2p"
    return "RING"  # all-reduce / gather / scatter on a ring; broadcast, reduce along it


def kernel_name(op: str, kind: str) -> str:
    """A compute kernel's name: the op, "...Backward" in backward (autograd's naming)."""
    return f"{op}Backward" if kind == "backward" else op


def comm_kernel_name(op: str) -> str:
    """ncclDevKernel_<Collective>_<algorithm>, as NCCL >= 2.19 names its kernels (real
    ones also carry the reduction, dtype and protocol: ..._AllReduce_Sum_bf16_RING_LL)."""
    name = NCCL_NAMES[op]
    return f"ncclDevKernel_{name}" if name == "SendRecv" else f"ncclDevKernel_{name}_RING"


def span_us(start: float, end: float) -> tuple[float, float]:
    """(ts, dur) in microseconds with ts + dur <= end * 1e6 exactly in floating point, so
    back-to-back kernels never overlap by a rounding error (viewers then nest them wrongly)."""
    ts, end_us = start * US, end * US
    dur = end_us - ts
    while dur > 0 and ts + dur > end_us:
        dur = math.nextafter(dur, 0.0)
    return ts, max(dur, 0.0)


def flow_id(message: tuple[int, int, int, int], world_size: int) -> int:
    """A number both ends of a message compute alike (viewers want integer flow ids)."""
    src, dst, tag, number = message
    return ((number * 65536 + tag % 65536) * world_size + src) * world_size + dst


def _streams(records) -> list[int]:
    """The stream of each comm record: its group kind's, or the next free one of that kind."""
    busy: dict[str, list[float]] = {}
    streams = []
    for record in records:
        lanes = busy.setdefault(record.group_kind, [])
        free = [lane for lane, end in enumerate(lanes) if end <= record.start]
        lane = free[0] if free else len(lanes)
        if not free:
            lanes.append(0.0)
        lanes[lane] = record.end
        streams.append(COMM_STREAMS[record.group_kind] + lane)
    return streams


def _memory_counters(history, pid: int) -> list[dict]:
    """One counter event per instant the ledger changed, with the bytes held at the end of
    that instant: an array held and released at one simulated instant (no compute between)
    leaves no mark on the counter, though the ledger's peak (and `minipar profile`) count it."""
    current = dict.fromkeys(CATEGORIES, 0)
    events: list[dict] = []
    for t, category, nbytes in history:
        current[category] = nbytes
        ts = t * US
        if events and events[-1]["ts"] == ts:
            events[-1]["args"] = dict(current)
        else:
            events.append({"ph": "C", "name": "Memory (bytes)", "pid": pid, "ts": ts,
                           "args": dict(current)})
    return events


def memory_peak(history) -> dict:
    """The largest total the ledger held, replayed from its history: bytes, the simulated
    moment ("at_s", the first time it was reached) and the bytes of each category then."""
    current = dict.fromkeys(CATEGORIES, 0)
    best = {"bytes": 0, "at_s": 0.0, "by_category": dict(current)}
    total = 0
    for t, category, nbytes in history:
        total += nbytes - current[category]
        current[category] = nbytes
        if total > best["bytes"]:
            best = {"bytes": total, "at_s": t, "by_category": dict(current)}
    return best


def rank_trace(device, steps=(), metadata: dict | None = None) -> dict:
    """One rank's trace as a dict (what `write_traces` writes to rank<N>.json).

    device: a Device that recorded a trace (`launch(..., trace=True)`).
    steps: ((step number, start s, end s), ...) on this rank's clock: ProfilerStep#N.
    metadata: more to keep under "minipar" (the config, the mesh coordinates, ...).
    """
    if device.trace is None:
        raise ValueError(f"rank {device.rank} recorded no trace: launch(..., trace=True)")
    rank, pid = device.rank, device.rank
    local = rank % device.gpus_per_node
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid,
         "args": {"name": f"rank {rank} (node {device.node}, GPU {local})"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": rank}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": HOST_TID,
         "args": {"name": "host (the rank's Python thread)"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMPUTE_STREAM,
         "args": {"name": f"stream {COMPUTE_STREAM} compute"}},
    ]
    for number, start, end in steps:
        ts, dur = span_us(start, end)
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}",
                       "pid": pid, "tid": HOST_TID, "ts": ts, "dur": dur, "args": {}})
    correlation = 0

    def launch(ts: float) -> dict:
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid,
                "tid": HOST_TID, "ts": ts, "dur": 0.0,
                "args": {"correlation": correlation, "External id": correlation}}

    for kind, op, label, start, end, flops in device.trace.kernels:
        correlation += 1
        ts, dur = span_us(start, end)
        events.append(launch(ts))
        args = {"stream": COMPUTE_STREAM, "device": local, "correlation": correlation,
                "External id": correlation, "kind": kind, "op": op, "flops": flops}
        if label:
            args["micro_batch"] = label
        events.append({"ph": "X", "cat": "kernel", "name": kernel_name(op, kind), "pid": pid,
                       "tid": COMPUTE_STREAM, "ts": ts, "dur": dur, "args": args})
    records = device.comm.records
    named: set[int] = set()
    for record, stream in zip(records, _streams(records), strict=True):
        correlation += 1
        if stream not in named:
            named.add(stream)
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": stream,
                           "args": {"name": f"stream {stream} nccl {record.group_kind}"}})
        ts, dur = span_us(record.start, record.end)
        events.append(launch(ts))
        ranks = list(record.group_ranks)
        events.append({
            "ph": "X", "cat": "kernel", "name": comm_kernel_name(record.op), "pid": pid,
            "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": local, "correlation": correlation,
                     "External id": correlation, "op": record.op,
                     "group": record.group_kind, "group_ranks": ranks,
                     "sent_bytes": record.sent_bytes, "recv_bytes": record.recv_bytes,
                     "algorithm": algorithm(record.op), "phase": record.phase,
                     # the names torch.profiler gives a collective's parameters
                     "Collective name": record.op, "Group size": len(ranks),
                     "Process Group Name": record.group_kind,
                     "Process Group Ranks": str(ranks)}})
        if record.message is not None:
            # The arrow leaves the send and ends on the matching recv (in the other rank's
            # file; both are in merged/all_ranks.json).
            phase = "s" if record.op == "send" else "f"
            flow = {"ph": phase, "id": flow_id(record.message, device.world_size),
                    "cat": "p2p", "name": "send -> recv", "pid": pid, "tid": stream,
                    "ts": ts, "args": {"message": list(record.message)}}
            if phase == "f":
                flow["bp"] = "e"  # bind to the enclosing slice (the recv kernel)
            events.append(flow)
    if device.memory.history is not None:
        events.extend(_memory_counters(device.memory.history, pid))
    profile = device.profile
    extra = dict(metadata or {})
    if device.memory.history is not None:
        extra["memory_peak"] = memory_peak(device.memory.history)
    return {
        # HTA finds a file's rank with the regex '"rank":\s+(\d+)' on the first line that
        # has one: distributedInfo comes first.
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": device.world_size},
        "schemaVersion": 1,
        "deviceProperties": [{"id": local, "name": profile.name, "peakFlops": profile.flops,
                              "intraNodeBandwidth": profile.intra_node_bandwidth,
                              "interNodeBandwidth": profile.inter_node_bandwidth}],
        "displayTimeUnit": "ns",
        "traceName": f"rank{rank}.json",
        "minipar": {"schema": TRACE_SCHEMA, "rank": rank, "node": device.node,
                    "gpus_per_node": device.gpus_per_node, "device": asdict(profile),
                    "end_s": device.clock.now, **extra},
        "traceEvents": events,
    }


def dump_trace(trace: dict, path: Path) -> None:
    """JSON with one event per line (as torch.profiler writes it: small diffs, greppable),
    written whole or not at all (minipar.files.atomic_write)."""
    head = {k: v for k, v in trace.items() if k != "traceEvents"}
    lines = [json.dumps(e) for e in trace["traceEvents"]]
    text = json.dumps(head, indent=1)[:-2] + ',\n "traceEvents": [\n' + ",\n".join(lines)
    with atomic_write(path, "w") as f:
        f.write(text + "\n ]\n}\n")


def write_traces(directory, devices, steps=None, metadata=None) -> list[Path]:
    """Write rank<N>.json for every device, and merged/all_ranks.json with every rank.

    steps: per rank, ((step number, start, end), ...); metadata: per rank, a dict for the
    "minipar" section. Returns the per-rank paths. The merged file sits in a subfolder
    because HTA reads every *.json of the trace folder as one rank.
    """
    traces = [rank_trace(device, () if steps is None else steps[i],
                         None if metadata is None else metadata[i])
              for i, device in enumerate(devices)]
    return dump_traces(directory, traces)


def dump_traces(directory, traces: list[dict]) -> list[Path]:
    """Write each rank's trace (a `rank_trace` dict, in rank order) and the merged file."""
    directory = Path(directory)
    (directory / "merged").mkdir(parents=True, exist_ok=True)
    paths = [directory / f"rank{trace['distributedInfo']['rank']}.json" for trace in traces]
    for trace, path in zip(traces, paths, strict=True):
        dump_trace(trace, path)
    head = {k: v for k, v in traces[0].items() if k not in ("traceEvents", "minipar")}
    backend = traces[0]["distributedInfo"]["backend"]
    dump_trace({**head, "distributedInfo": {"backend": backend, "world_size": len(traces)},
                "traceName": "all ranks",
                "traceEvents": [e for trace in traces for e in trace["traceEvents"]]},
               directory / "merged" / "all_ranks.json")
    return paths


def device_profile(values: dict) -> DeviceProfile:
    """The DeviceProfile a trace's "minipar"."device" section describes (JSON turned the
    roofline into a dict and its tile into a list)."""
    roofline = values.get("roofline")
    if roofline is not None:
        roofline = Roofline(**{**roofline, "tile": tuple(roofline["tile"])})
    return DeviceProfile(**{**values, "roofline": roofline})


def peak_flops(values: dict) -> float:
    """The peak FLOP/s of a trace's device: MFU's denominator (the roofline's tensor-core
    peak on a roofline profile, else the one rate every FLOP runs at)."""
    roofline = values.get("roofline")
    return values["flops"] if roofline is None else roofline["peak_flops"]


class TraceError(MiniparError, ValueError):
    """A trace folder minipar cannot read (missing, empty, not its format)."""


def read_trace_files(directory, error=None) -> list[tuple[Path, dict]]:
    """(path, JSON) of each rank<N>.json of `directory`, in file order: JSON objects marked
    as minipar traces (their schema), their values not yet checked
    (minipar.profile.trace_input checks every value the profile reads). Only JSON is read.
    error(path, message): the exception to raise (default: a TraceError "path: message")."""
    fail = error or (lambda path, message: TraceError(f"{path}: {message}"))
    directory = Path(directory)
    if not directory.is_dir():
        raise fail(directory, "is not a folder of traces (minipar train --trace DIR writes one)")
    files = []
    for path in sorted(directory.glob("rank*.json")):
        try:  # a regular file of bounded size only: a FIFO would block, /dev/zero never end
            trace = load_json(path, what="trace")
        except (OSError, InputFileError) as err:
            reason = getattr(err, "detail", None) or getattr(err, "strerror", None) or err
            raise fail(path, f"not a JSON trace ({reason})") from None
        meta = trace.get("minipar") if isinstance(trace, dict) else None
        if not isinstance(trace, dict) or "minipar" not in trace:
            raise fail(path, f"not a minipar trace (a JSON object whose minipar.schema is "
                       f"{TRACE_SCHEMA})")
        if not isinstance(meta, dict):
            raise fail(path, f"minipar: must be an object ({{...}}), got {type(meta).__name__}")
        if meta.get("schema") != TRACE_SCHEMA:
            raise fail(path, f"not a minipar trace: minipar.schema is "
                       f"{meta.get('schema')!r}, not {TRACE_SCHEMA}")
        files.append((path, trace))
    if not files:
        raise fail(directory, "no rank<N>.json traces in it (minipar train --trace DIR "
                   "writes them)")
    return files


def read_traces(directory) -> list[dict]:
    """The per-rank traces of a folder written by `write_traces`, in rank order."""
    traces = [trace for _, trace in read_trace_files(directory)]
    info = [t.get("distributedInfo") for t in traces]
    if not all(isinstance(i, dict) and type(i.get("rank")) is int
               and type(i.get("world_size")) is int for i in info):  # (a KeyError before)
        raise TraceError(f"{directory}: a trace without an integer distributedInfo.rank "
                         "and world_size (minipar.profile.trace_input names which)")
    traces.sort(key=lambda t: t["distributedInfo"]["rank"])
    world = traces[0]["distributedInfo"]["world_size"]
    if [t["distributedInfo"]["rank"] for t in traces] != list(range(world)):
        raise TraceError(f"{directory} does not hold one trace per rank 0..{world - 1}")
    return traces
