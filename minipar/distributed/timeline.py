"""Busy and idle time of the ranks, read from their simulated clocks' timelines.

    rows = time_breakdown([d.clock.events for d in devices])   # compute/comm/idle per rank
    bubble = bubble_fraction(report.timelines)                 # idle share of rank-time
    communication_bound(report.timelines)                      # True: the formula misleads

A timeline is one rank's list of `TimelineEvent`s (clock.py) or of report-style
{"kind", "start", "end"} dicts. Idle time is what the pipeline literature calls the
bubble (Huang et al. 2019, GPipe; Narayanan et al. 2021), so pipeline.py re-exports these
two; they apply to any run, whose idle time also includes waiting for a collective.
"""

from __future__ import annotations


def _events(timeline):
    for event in timeline:
        if isinstance(event, dict):
            yield event["kind"], event["start"], event["end"]
        else:
            yield event.kind, event.start, event.end


def time_breakdown(timelines, start: float | None = None,
                   end: float | None = None) -> list[dict[str, float]]:
    """Per rank, seconds of compute, comm and idle within [start, end] (default: from the
    first event of any rank to the last). Time a rank has no event for (it returned
    before the slowest rank) is idle."""
    events = [list(_events(t)) for t in timelines]
    if start is None:
        start = min((e[1] for t in events for e in t), default=0.0)
    if end is None:
        end = max((e[2] for t in events for e in t), default=start)
    rows = []
    for timeline in events:
        compute = comm = 0.0
        for kind, s, e in timeline:
            overlap = min(e, end) - max(s, start)
            if overlap <= 0 or kind == "idle":
                continue
            if kind == "comm":
                comm += overlap
            else:
                compute += overlap
        rows.append({"compute_s": compute, "comm_s": comm,
                     "idle_s": max(0.0, (end - start) - compute - comm)})
    return rows


def bubble_fraction(timelines, start: float | None = None, end: float | None = None) -> float:
    """Idle time / total time, summed over ranks, from the simulated clocks' timelines
    (lists of TimelineEvent or of {"kind", "start", "end"} dicts, one per rank).

    Idle is time neither computing nor communicating: waiting for a neighbour's
    activation or gradient (the pipeline bubble), for a collective's last member, or
    after finishing early. With uniform stages and free communication this is the
    schedule's own formula, minipar.parallel.pipeline.schedules.registry.uniform_bubble_fraction
    ((p - 1) / (m + p - 1) for GPipe and 1F1B).
    """
    rows = time_breakdown(timelines, start, end)
    total = sum(r["compute_s"] + r["comm_s"] + r["idle_s"] for r in rows)
    return 0.0 if total <= 0 else sum(r["idle_s"] for r in rows) / total


# --- communication hidden behind compute -------------------------------------------------
def merge_intervals(intervals) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of (start, end) pairs (empty ones dropped)."""
    merged: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a, b) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_overlap(compute, comm) -> dict[str, float]:
    """How much communication compute hides, from (start, end) spans of one rank.

    compute: spans when the rank's compute stream is busy; comm: spans when a transfer
    runs (a CommRecord's start..end, also while the rank computes on: async collectives,
    isend). Returns seconds of
      compute_s          the union of the compute spans
      comm_s             the union of the communication spans
      overlapped_comm_s  communication while compute runs
      exposed_comm_s     communication while nothing computes (comm_s - overlapped)
      busy_s             compute or communication
    Exposed communication is Holistic Trace Analysis's "non-compute" time and
    overlapped / comm its comm-comp overlap (hta/analyzers/breakdown_analysis.py,
    communication_analysis.py), so the two tools agree on a trace of the same run.
    """
    compute, comm = merge_intervals(compute), merge_intervals(comm)
    compute_s, comm_s = _length(compute), _length(comm)
    overlapped = _intersection(compute, comm)
    return {"compute_s": compute_s, "comm_s": comm_s, "overlapped_comm_s": overlapped,
            "exposed_comm_s": comm_s - overlapped, "busy_s": compute_s + comm_s - overlapped}


def device_comm_overlap(device) -> dict[str, float]:
    """`comm_overlap` of one Device: compute from its clock, transfers from its byte ledger."""
    compute = [(e.start, e.end) for e in device.clock.events if e.kind not in ("comm", "idle")]
    return comm_overlap(compute, [(r.start, r.end) for r in device.comm.records])


def communication_share(timelines) -> float:
    """Communication / busy (compute + communication) time, summed over ranks."""
    rows = time_breakdown(timelines)
    busy = sum(r["compute_s"] + r["comm_s"] for r in rows)
    return 0.0 if busy <= 0 else sum(r["comm_s"] for r in rows) / busy


# Above this share of busy time in communication a run is communication-bound.
COMMUNICATION_BOUND_SHARE = 0.5


def communication_bound(timelines) -> bool:
    """True when the ranks spend more time communicating than computing.

    The bubble formulas above assume stages that compute and communicate for free. A toy
    model on a fast GPU profile (the CLI's default h100) computes a micro-batch in about
    a microsecond and pays each message's latency (alpha, microseconds) on top, so its
    idle share says little about (p - 1) / (m + p - 1): comparing the two looks like a
    bug. Front ends then say the formula does not apply instead of comparing."""
    return communication_share(timelines) > COMMUNICATION_BOUND_SHARE
def labelled_compute_seconds(timeline) -> dict[str, float]:
    """Seconds of compute per label over one rank's timeline (labels such as "F3", "I3",
    "W3.1" name a pipeline action: `minipar.distributed.timeline_label`). Communication
    inside an action (a tensor-parallel all-reduce) is not counted."""
    seconds: dict[str, float] = {}
    for event in timeline:
        kind, label = ((event["kind"], event.get("label", "")) if isinstance(event, dict)
                       else (event.kind, event.label))
        if label and kind in ("forward", "backward"):
            start, end = ((event["start"], event["end"]) if isinstance(event, dict)
                          else (event.start, event.end))
            seconds[label] = seconds.get(label, 0.0) + end - start
    return seconds
