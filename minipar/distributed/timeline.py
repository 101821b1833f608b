"""Busy and idle time of the ranks, read from their simulated clocks' timelines.

    rows = time_breakdown([d.clock.events for d in devices])   # compute/comm/idle per rank
    bubble = bubble_fraction(report.timelines)                 # idle share of rank-time

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
    schedule's own formula, minipar.parallel.schedules.uniform_bubble_fraction
    ((p - 1) / (m + p - 1) for GPipe and 1F1B).
    """
    rows = time_breakdown(timelines, start, end)
    total = sum(r["compute_s"] + r["comm_s"] + r["idle_s"] for r in rows)
    return 0.0 if total <= 0 else sum(r["idle_s"] for r in rows) / total
