"""A traced run's files as `minipar profile` reads them: every value it uses, checked once.

    from minipar.profile.trace_input import load_traces
    traces = load_traces("trace/")      # rank<N>.json of minipar train --trace trace/

Where a file's JSON becomes the profile's input, each value the profile reads is checked
(minipar.distributed.trace writes them): the keys it needs, of the type it needs,
numbers finite, times and durations >= 0, what it divides by (the run's end, the
device's peak FLOP/s) > 0, ranks and world sizes integers, every rank's file once and
all of one run (the same world size, config and device). The first value that is not
so is one `TraceFileError` naming the file, where in it (`minipar.end_s`,
`traceEvents[12].dur`) and what is wrong: the CLI prints it as one line, exit status 2,
and no report comes out of nonsense (a NaN duration would have read as 100% idle).
Only JSON is read, from regular files of bounded size (minipar.files; nothing is
unpickled). `check_traces` is the same check on traces already loaded
(`minipar.profile.breakdown.profile_traces` runs it), and `check_figures` checks what the
profile derives from them: values each in range can still combine into nonsense.
"""

from __future__ import annotations

import json
import math
import re
from typing import NoReturn

from minipar.distributed.memory import CATEGORIES
from minipar.distributed.trace import (
    COMPUTE_STREAM,
    TraceError,
    device_profile,
    peak_flops,
    read_trace_files,
)
from minipar.errors import ConfigError, MiniparError

US = 1e6  # seconds -> trace microseconds
# The largest values a traced run can hold. Each is far past any run minipar simulates,
# and keeps the figures made of them printable: a run of 1e300 s or a peak of 10**400
# bytes passed every other check and came out as a 300-digit time or an OverflowError.
MAX_SECONDS = 1e9  # of simulated time (31 years)
MAX_BYTES = 2**63  # what a 64-bit counter holds (8 EiB)
# Model FLOPs (MFU's numerator) over the FLOPs the kernels executed (HFU's): below 1 for
# a dense model (recomputation, attention's softmax), above only where MoE layers drop
# tokens over capacity (1.35 with a capacity factor of 0.01); a thousand is no run's.
MAX_MODEL_OVER_EXECUTED = 1000
STEP = re.compile(r"ProfilerStep#(\d+)", re.ASCII)
MESH = ("dp", "pp", "tp")  # the mesh coordinates the report shows


class TraceFileError(TraceError, ConfigError):
    """A trace file (or folder) `minipar profile` cannot use. The message is the file,
    then where in it and what is wrong; `path` is the file. A ConfigError whose setting
    is the command's DIR argument (the CLI prints it as one line, exit status 2), and a
    TraceError (what minipar.distributed.read_traces raises)."""

    def __init__(self, path, message: str):
        self.path, self.setting, self.detail = str(path), "DIR", message
        # not ConfigError's "--flag: " prefix: no flag is wrong, the file is
        super(ConfigError, self).__init__(f"{path}: {message}")


def _shown(value) -> str:
    """A value as the file has it (JSON), cut to a readable length."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _File:
    """The checks of one file: each raises TraceFileError naming it and the key."""

    def __init__(self, source):
        self.source = source

    def fail(self, where: str, problem: str) -> NoReturn:
        raise TraceFileError(self.source, f"{where}: {problem}")

    def get(self, node: dict, key: str, where: str):
        if key not in node:
            self.fail(f"{where}.{key}" if where else key, "missing")
        return node[key]

    def object(self, node: dict, key: str, where: str = "") -> dict:
        value = self.get(node, key, where)
        if not isinstance(value, dict):
            self.fail(f"{where}.{key}" if where else key,
                      f"must be an object ({{...}}), got {_shown(value)}")
        return value

    def string(self, node: dict, key: str, where: str) -> str:
        value = self.get(node, key, where)
        if not isinstance(value, str):
            self.fail(f"{where}.{key}", f"must be a string, got {_shown(value)}")
        return value

    def integer(self, node: dict, key: str, where: str, low: int = 0,
                most: float | None = None) -> int:
        value = self.get(node, key, where)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            self.fail(f"{where}.{key}", f"must be an integer >= {low}, got {_shown(value)}")
        self.at_most(value, most, f"{where}.{key}")
        return value

    def at_most(self, value, most: float | None, name: str) -> None:
        if most is not None and value > most:
            self.fail(name, f"must be at most {most:.3g} (no run minipar simulates comes "
                      f"near), got {_shown(value)}")

    def number(self, node: dict, key: str, where: str, positive: bool = False,
               most: float | None = None) -> float:
        """A finite number >= 0 (> 0 if `positive`), at most `most`."""
        value = self.get(node, key, where)
        name = f"{where}.{key}"
        if not isinstance(value, int | float) or isinstance(value, bool):
            self.fail(name, f"must be a number, got {_shown(value)}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer too large for a float
            finite = False
        if not finite:
            self.fail(name, f"must be finite, got {_shown(value)}")
        if value < 0 or (positive and value == 0):
            self.fail(name, f"must be {'> 0' if positive else '>= 0'}, got {_shown(value)}")
        self.at_most(value, most, name)
        return float(value)


# ------------------------------------------------------------------ reading the folder
def load_traces(directory) -> list[dict]:
    """The checked traces of a folder written by `minipar train --trace`, in rank order."""
    files = read_trace_files(directory, TraceFileError)
    return check_traces([t for _, t in files], [p for p, _ in files])


# ------------------------------------------------------------------ checking the traces
def check_traces(traces: list[dict], sources=None) -> list[dict]:
    """`traces` (one run's, a file's JSON each) checked, in rank order, each with its
    config completed to every setting (TrainConfig.to_dict); else TraceFileError naming
    the source (`sources`: the file of each trace; by default its traceName)."""
    if not traces:
        raise TraceFileError("traces", "none given (one per rank of the run)")
    if sources is None:
        sources = [t.get("traceName") if isinstance(t, dict)
                   and isinstance(t.get("traceName"), str) else f"traces[{i}]"
                   for i, t in enumerate(traces)]
    checked = [_check_trace(trace, source) for trace, source in zip(traces, sources,
                                                                     strict=True)]
    _check_one_run(checked, sources)
    window = max(c["end_s"] for c in checked)
    for c, source in zip(checked, sources, strict=True):
        last, index = c["last_end_us"]
        if last > window * US * (1 + 1e-9):
            _File(source).fail(f"traceEvents[{index}]", f"ends at {last:g} us, after the "
                               f"run's end (the latest minipar.end_s, {window:g} s = "
                               f"{window * US:g} us)")
        if c["peak_at_s"] > window * (1 + 1e-9):
            _File(source).fail("minipar.memory_peak.at_s", f"{c['peak_at_s']:g} s is after "
                               f"the run's end (the latest minipar.end_s, {window:g} s)")
    by_rank = sorted(zip(checked, traces, strict=True), key=lambda ct: ct[0]["rank"])
    return [{**trace, "minipar": {**trace["minipar"], "config": c["config"]}}
            for c, trace in by_rank]


def _check_one_run(checked: list[dict], sources) -> None:
    """Every rank of one run once: the same world size, config and device in each file."""
    first, head = checked[0], sources[0]
    for c, source in zip(checked, sources, strict=True):
        for key, where in (("world_size", "distributedInfo.world_size"),
                           ("config", "minipar.config"), ("device", "minipar.device")):
            if c[key] != first[key]:
                diff = (f"{c[key]}, not {first[key]}" if key == "world_size" else
                        _difference(c[key], first[key]))
                _File(source).fail(where, f"{diff} as in {head}: the folder mixes "
                                   "the traces of different runs")
    world = first["world_size"]
    seen: dict[int, object] = {}
    for c, source in zip(checked, sources, strict=True):
        if c["rank"] in seen:
            _File(source).fail("distributedInfo.rank", f"rank {c['rank']} again "
                               f"({seen[c['rank']]} is rank {c['rank']} too)")
        seen[c["rank"]] = source
    missing = [r for r in range(world) if r not in seen]
    if missing:
        _File(head).fail("distributedInfo.world_size", f"{world} ranks, but there is no "
                         f"trace of rank {missing[0]} (rank{missing[0]}.json) beside it")


def _difference(values: dict, reference: dict) -> str:
    keys = sorted(k for k in set(values) | set(reference) if values.get(k) != reference.get(k))
    key = keys[0]
    return f"{key} is {_shown(values.get(key))}, not {_shown(reference.get(key))}"


def _check_trace(trace, source) -> dict:
    """What the profile needs of one file, checked; returns the figures the cross-file
    checks use (rank, world size, config, device, end, the last kernel's end)."""
    f = _File(source)
    if not isinstance(trace, dict):
        f.fail("the file", f"must be a JSON object, got {_shown(trace)}")
    info = f.object(trace, "distributedInfo")
    world = f.integer(info, "world_size", "distributedInfo", low=1)
    rank = f.integer(info, "rank", "distributedInfo")
    if rank >= world:
        f.fail("distributedInfo.rank", f"{rank} is not a rank of world_size {world} "
               f"(0..{world - 1})")
    meta = f.object(trace, "minipar")
    config = _check_config(f, meta, world)
    device = _check_device(f, meta)
    end = f.number(meta, "end_s", "minipar", positive=True, most=MAX_SECONDS)
    coords = f.object(meta, "coords", "minipar")
    for axis in MESH:
        value = f.integer(coords, axis, "minipar.coords")
        if value >= config[axis]:
            f.fail(f"minipar.coords.{axis}", f"{value} is outside the run's {axis} "
                   f"{config[axis]} (0..{config[axis] - 1})")
    peak = f.object(meta, "memory_peak", "minipar")
    peak_bytes = f.integer(peak, "bytes", "minipar.memory_peak", most=MAX_BYTES)
    at = f.number(peak, "at_s", "minipar.memory_peak")
    by_category = f.object(peak, "by_category", "minipar.memory_peak")
    for key in by_category:
        if key not in CATEGORIES:
            f.fail(f"minipar.memory_peak.by_category.{key}", "not a memory category "
                   f"(one of {', '.join(CATEGORIES)})")
    held = sum(f.integer(by_category, c, "minipar.memory_peak.by_category", most=MAX_BYTES)
               for c in CATEGORIES)
    if held != peak_bytes:
        f.fail("minipar.memory_peak.bytes", f"{peak_bytes}, but the sum of by_category "
               f"is {held}")
    last_end = _check_events(f, trace)
    return {"rank": rank, "world_size": world, "config": config, "device": device,
            "end_s": end, "last_end_us": last_end, "peak_at_s": at}


def _check_config(f: _File, meta: dict, world: int) -> dict:
    """The run's config: a TrainConfig minipar can train (every setting, as to_dict)."""
    from minipar.train.config import TrainConfig
    from minipar.train.mixes import check_layout

    values = f.object(meta, "config", "minipar")
    try:  # (an unknown setting too: from_dict names it)
        config = TrainConfig.from_saved(values)
        check_layout(config)
    except ConfigError as err:
        f.fail(f"minipar.config.{err.setting}", f"{err.detail} (the traced run's config is "
               "invalid)")
    except (MiniparError, ValueError, TypeError) as err:
        f.fail("minipar.config", f"not a config minipar can train ({err})")
    if config.world_size != world:
        f.fail("minipar.config", f"a run of world size {config.world_size} (dp x tp x pp x "
               f"cp = {config.dp} x {config.tp} x {config.pp} x {config.cp}), but "
               f"distributedInfo.world_size is {world}")
    return config.to_dict()


def _check_device(f: _File, meta: dict) -> dict:
    """The simulated GPU: a DeviceProfile, with a finite peak FLOP/s > 0 (MFU divides)."""
    device = f.object(meta, "device", "minipar")
    f.string(device, "name", "minipar.device")
    f.number(device, "flops", "minipar.device", positive=True)
    roofline = f.get(device, "roofline", "minipar.device")
    if roofline is not None:
        if not isinstance(roofline, dict):
            f.fail("minipar.device.roofline", f"must be null or an object, got "
                   f"{_shown(roofline)}")
        f.number(roofline, "peak_flops", "minipar.device.roofline", positive=True)
    try:
        device_profile(device)
    except (TypeError, ValueError, KeyError) as err:
        f.fail("minipar.device", f"not a device profile ({err})")
    if not math.isfinite(peak_flops(device)):
        f.fail("minipar.device", "its peak FLOP/s must be finite")
    return device


def _check_events(f: _File, trace: dict) -> tuple[float, int]:
    """The kernels and ProfilerStep annotations; returns (the latest end in us, its event
    index) for the check against the run's end."""
    events = f.get(trace, "traceEvents", "")
    if not isinstance(events, list):
        f.fail("traceEvents", f"must be a list of events, got {_shown(events)}")
    compute = steps = 0
    last = (0.0, 0)
    for i, event in enumerate(events):
        where = f"traceEvents[{i}]"
        if not isinstance(event, dict):
            f.fail(where, f"must be an object (an event), got {_shown(event)}")
        cat = event.get("cat")
        if cat == "kernel":
            compute += _check_kernel(f, event, where)
        elif cat == "user_annotation":
            name = f.string(event, "name", where)
            if not name.startswith("ProfilerStep#"):
                continue
            if STEP.fullmatch(name) is None:
                f.fail(f"{where}.name", f"{_shown(name)} is not ProfilerStep#<step number>")
            steps += 1
        else:
            continue
        end = f.number(event, "ts", where) + f.number(event, "dur", where)
        last = max(last, (end, i))
    if not compute:
        f.fail("traceEvents", f"no compute kernel (cat kernel on stream {COMPUTE_STREAM}): "
               "not the trace of a training run")
    if not steps:
        f.fail("traceEvents", "no ProfilerStep#N annotation: not the trace of a training "
               "run (minipar train --trace)")
    return last


def _check_kernel(f: _File, event: dict, where: str) -> int:
    """A kernel's name and args; 1 for a compute kernel, 0 for communication."""
    f.string(event, "name", where)
    args = f.object(event, "args", where)
    where += ".args"
    stream = f.integer(args, "stream", where)
    f.string(args, "op", where)
    if stream == COMPUTE_STREAM:
        f.string(args, "kind", where)
        f.number(args, "flops", where)
        if "micro_batch" in args:
            f.string(args, "micro_batch", where)
        return 1
    f.string(args, "group", where)
    f.number(args, "sent_bytes", where, most=MAX_BYTES)
    return 0


# ------------------------------------------------------------------ checking the figures
def check_figures(profile, files: dict | None = None, folder="traces") -> None:
    """The figures a profile derived from checked traces, checked in turn: values each
    in range can combine into nonsense (kernels of 1e300 FLOPs: an HFU of 1e285; a sum
    of them: `inf`, then `nan%`). Every figure finite; the run's length times the
    device's peak above 0 (MFU and HFU divide by it); every rank's HFU at most 100% (no
    rank executes more FLOPs than its device's peak over the run); and the model FLOPs
    of the run's config at most MAX_MODEL_OVER_EXECUTED times the FLOPs its kernels
    executed (MFU over HFU: more than 1 only where MoE layers drop tokens over capacity,
    which the model FLOPs count). Else one TraceFileError naming the figure and the
    rank's file (`files`: by rank), or the folder."""
    def fail(where, name: str, value, problem: str) -> NoReturn:
        shown = f"{value:.3g}" if isinstance(value, float) else _shown(value)
        raise TraceFileError(where, f"the profile's {name} is {shown}: {problem}; "
                             "the trace's values are each in range, together they are not "
                             "a run minipar could have traced")

    def source(name: str):
        match = re.match(r"ranks\[(\d+)\]", name)
        rank = profile.ranks[int(match.group(1))]["rank"] if match else None
        return (files or {}).get(rank, folder)

    if not profile.window_s * peak_flops(profile.device) > 0:
        fail(folder, "run length x device peak", profile.window_s * peak_flops(profile.device),
             "0 (it divides MFU and HFU)")
    for name, value in _numbers(profile.to_dict()):
        try:
            finite = math.isfinite(value)
        except OverflowError:
            finite = False
        if not finite:
            fail(source(name), name, value, "not a finite number")
        if re.fullmatch(r"ranks\[\d+\]\.hfu", name) and value > 1 + 1e-6:
            fail(source(name), name, value, "over 100%, more FLOPs than the device's peak "
                 "over the run")
    hfu = sum(r["hfu"] for r in profile.ranks) / len(profile.ranks)  # the run's
    if profile.mfu > MAX_MODEL_OVER_EXECUTED * hfu:
        fail(folder, "mfu", profile.mfu, f"over {MAX_MODEL_OVER_EXECUTED} times its HFU "
             f"({hfu:.3g}): its config's model needs that many times the FLOPs its "
             "kernels executed")


def _numbers(value, name: str = ""):
    """(dotted name, number) of every number in a profile's dict."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{name}[{i}]")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield name, value
