"""What a real engine measures besides the ledgers: wall time, and traces on the wall clock.

On the torch engine every rank is a `MeasuredDevice`: the same Device (the same ledgers and
simulated clock, so the reports agree with the thread engine's), which also notes the wall
time at which each op ended. While tracing, every op's measured span is kept: from the end
of the previous op or communication to the end of this one, so the Python between two
NumPy calls counts with the op after it (what a CPU profiler would attribute to it too).

`wall_view(device)` turns a traced device into what trace.py's `rank_trace` reads,
with every time on the wall clock (seconds since the launch's common start): compute spans
as measured, each communication from its call to gloo's completion, the memory counters
at the wall time their change was booked. So `minipar profile` and Holistic Trace
Analysis read a measured trace as they read a simulated one.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import time

from .device import Device
from .trace import HOST_TID, US, TraceRecorder, rank_trace


class MeasuredDevice(Device):
    """A Device that also keeps the wall clock (seconds since `epoch`, a perf_counter()
    reading every rank took at the same moment, after a barrier)."""

    def __init__(self, *args, epoch: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = epoch
        self._mark = time.perf_counter()  # when the last op or communication ended
        self.wall_kernels: list[tuple] = []  # (kind, op, label, start, end, flops), traced
        self.moments: list[tuple[float, float]] = []  # (simulated, wall) at each op's end
        self.spans: list[tuple[float, float]] = []  # wall (start, end) per comm record
        self.waits: list[tuple[float, float]] = []  # ... and when the rank waited for it

    def compute(self, flops: float, kind: str, kernels=None, op: str = "") -> None:
        super().compute(flops, kind, kernels, op)
        now = time.perf_counter()
        if self.trace is not None:
            self.wall_kernels.append((kind, op or kind, self.clock.compute_label,
                                      self._mark - self.epoch, now - self.epoch, flops))
            self.moments.append((self.clock.now, now - self.epoch))
        self._mark = now

    def communicated(self, start: float, end: float, blocked: float) -> None:
        """A communication call returned (about to be booked in the comm ledger): it ran
        from `start` to `end` and the rank waited for it from `blocked` to now
        (perf_counter seconds); the next op's span starts now."""
        self.spans.append((start - self.epoch, end - self.epoch))
        self._mark = time.perf_counter()
        self.waits.append((blocked - self.epoch, self._mark - self.epoch))
        if self.trace is not None:
            self.moments.append((self.clock.now, self._mark - self.epoch))

    def __getstate__(self) -> dict:
        """What crosses to the launching process: the figures, not the machinery (the
        cluster, the ledgers' references to the arrays they count)."""
        state = dict(self.__dict__)
        state["_cluster"], state["_pending_works"] = None, {}
        for name in ("memory", "memory_host", "memory_nvme"):
            ledger = state[name] = copy.copy(state[name])
            ledger.moment, ledger._held = None, {}
        return state


class _Records:
    def __init__(self, records) -> None:
        self.records = records


class _Memory:
    def __init__(self, history) -> None:
        self.history = history


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now


@dataclasses.dataclass
class WallView:
    """A traced MeasuredDevice's figures on the wall clock, in the attributes rank_trace
    reads (the simulated ones stay on the device)."""

    rank: int
    world_size: int
    gpus_per_node: int
    node: int
    profile: object
    trace: TraceRecorder
    comm: _Records
    memory: _Memory
    clock: _Clock


def wall_view(device: MeasuredDevice, since: float = 0.0) -> WallView:
    """A traced device on the wall clock (seconds since its epoch). An op's span begins
    `since` at the earliest (the first step's start: the op before it is the model's set-up,
    not an op)."""
    recorder = TraceRecorder()
    recorder.kernels = [(kind, op, label, max(start, min(since, end)), end, flops)
                        for kind, op, label, start, end, flops in device.wall_kernels]
    records = [dataclasses.replace(r, start=s, end=max(s, e))
               for r, (s, e) in zip(device.comm.records, device.spans, strict=True)]
    simulated = [s for s, _ in device.moments]

    def wall(t: float) -> float:  # when the simulated clock reached t
        i = bisect.bisect_left(simulated, t)
        return device.moments[min(i, len(simulated) - 1)][1] if simulated else 0.0

    history = None
    if device.memory.history is not None:
        history = [(wall(t), category, nbytes) for t, category, nbytes in device.memory.history]
    end = max([k[4] for k in recorder.kernels] + [r.end for r in records], default=0.0)
    return WallView(device.rank, device.world_size, device.gpus_per_node, device.node,
                    device.profile, recorder, _Records(records), _Memory(history), _Clock(end))


def wall_trace(device: MeasuredDevice, steps=(), metadata=None,
               algorithms: dict | None = None) -> dict:
    """rank_trace of the wall view, marked as measured: `minipar.clock` is "wall", the
    backend gloo's, each communication's algorithm the one gloo ran."""
    since = min((s for _, s, _ in steps), default=0.0)
    trace = rank_trace(wall_view(device, since), steps, {**(metadata or {}), "clock": "wall"})
    trace["distributedInfo"]["backend"] = "gloo"
    # What the rank's thread waited for each communication (the simulated timeline's
    # comm and idle), as the CPU ops of a torch.profiler trace (ProcessGroup waits).
    trace["traceEvents"] += [
        {"ph": "X", "cat": "cpu_op", "name": f"wait {record.op}", "pid": device.rank,
         "tid": HOST_TID, "ts": s * US, "dur": max(0.0, e - s) * US,
         "args": {"op": record.op, "group": record.group_kind}}
        for record, (s, e) in zip(device.comm.records, device.waits, strict=True)]
    # the run ends with the rank program's last mark, after its last op
    trace["minipar"]["end_s"] = max([trace["minipar"]["end_s"]] + [e for _, _, e in steps])
    for event in trace["traceEvents"]:
        args = event.get("args", {})
        if event.get("cat") == "kernel" and "group_ranks" in args and algorithms:
            args["algorithm"] = algorithms.get(args["op"], args["algorithm"])
    return trace
