"""A run on a real engine: what it measured, the cross-check's table, and the two timelines.

    print(engine_text(report))                    # engine, hosts, wall time, wire vs ledger
    print(cross_check_table(results))             # minipar check --engine torch
    fig = plot_simulated_and_measured("trace/")   # minipar train --engine torch --trace trace/

The figure puts one step of a traced torch-engine run side by side: on the left the
simulated clock (trace/simulated/rank<N>.json, what the thread engine would draw), on the
right the wall clock of the same step on the processes (trace/rank<N>.json). The same
kinds in the same colours (viz/timeline.py): the shape of the schedule is the same; the
proportions are those of a CPU running NumPy and gloo on TCP rather than of the simulated
GPUs, and each rank's row starts where its own step did.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minipar.distributed.trace import COMPUTE_STREAM, read_traces
from minipar.viz.tables import format_table, human_bytes
from minipar.viz.timeline import COLORS, TIME_UNITS

US = 1e6


def engine_text(report) -> str:
    """The engine that ran the report, and per rank what it measured (torch engine)."""
    engine = report.engine
    hosts = sorted(set(engine["hosts"]))
    head = (f"engine: {engine['name']} ({engine['backend']}), {engine['world_size']} "
            f"rank(s) on {len(hosts)} host(s) ({', '.join(hosts)})")
    if engine.get("startup_s") is not None:
        head += f", started in {engine['startup_s']:.1f} s ({engine.get('launcher')})"
    measured = [r.get("measured") for r in report.ranks]
    if not all(measured):
        return head
    rows = []
    for rank, (m, summary) in enumerate(zip(measured, report.ranks, strict=True)):
        steps = m["wall_step_s"]
        later = steps[1:] or steps  # the first step also pays for warming up
        ledger = summary["comm"]["sent_bytes"]
        wire = m.get("wire_sent_bytes")
        comm = m.get("wall_comm_s")
        rows.append([rank, f"{1e3 * sum(later) / len(later):.1f} ms",
                     "-" if comm is None else f"{comm:.3f} s", human_bytes(ledger),
                     "-" if wire is None else human_bytes(wire),
                     "-" if wire is None or not ledger else f"{wire / ledger:.2f}x"])
    table = format_table(["rank", "wall per step", "in comm", "ledger sent", "wire sent",
                          "wire / ledger"], rows)
    wire = ("; bytes on the TCP sockets, gloo's framing and minipar's clock exchange "
            "included" if any(m.get("wire_sent_bytes") is not None for m in measured) else "")
    return f"{head}\nmeasured (wall time per step after the first{wire}):\n{table}"


def cross_check_table(results) -> str:
    """One row per case of `minipar check --engine torch` (train/crosscheck.py)."""
    rows = [[r.name, r.world_size, "equal" if r.ledgers_equal else
             "DIFFER: " + ", ".join(r.differing),
             "bit-identical" if r.identical else f"{r.max_rel_diff:.1e}",
             "-" if r.equivalence is None else
             ("passed" if r.equivalence["passed"] else "FAILED"),
             f"{r.seconds.get('threads', 0):.1f} s / {r.seconds.get('torch', 0):.1f} s"]
            for r in results]
    return format_table(["case", "ranks", "ledgers (torch vs threads)",
                         "numbers (max rel diff)", "vs one device", "threads / torch"], rows)


def trace_rows(traces, step: int = -1):
    """Per rank, (kind, start, end, label) in seconds from its own start of `step` (the
    ProfilerStep annotations), from rank traces (trace.py's format)."""
    rows = []
    for trace in traces:
        events = trace["traceEvents"]
        steps = sorted((e for e in events if e.get("name", "").startswith("ProfilerStep#")),
                       key=lambda e: e["ts"])
        window = steps[step]
        t0, t1 = window["ts"], window["ts"] + window["dur"]
        row = []
        measured = any(e.get("cat") == "cpu_op" for e in events)
        for e in events:
            if "dur" not in e or e["ts"] + e["dur"] <= t0 or e["ts"] >= t1:
                continue
            args = e.get("args", {})
            if e.get("cat") == "kernel" and args.get("stream") == COMPUTE_STREAM:
                kind = args["kind"]
            elif e.get("cat") == ("cpu_op" if measured else "kernel"):
                kind = "comm"  # measured: the rank's waits; simulated: the transfers
            else:
                continue
            row.append((kind, (max(e["ts"], t0) - t0) / US,
                        (min(e["ts"] + e["dur"], t1) - t0) / US, args.get("micro_batch", "")))
        rows.append((row, (t1 - t0) / US))
    return rows


def _panel(ax, rows, title: str, clock: str) -> None:
    longest = max(length for _, length in rows)
    unit, scale = next(((u, s) for u, s in TIME_UNITS if longest >= 2 * s), TIME_UNITS[-1])
    for y, (row, length) in enumerate(rows):
        ax.broken_barh([(0, length / scale)], (y - 0.4, 0.8), color=COLORS["idle"])
        by_kind: dict[str, list] = {}
        for kind, s, e, _ in row:
            by_kind.setdefault(kind, []).append((s / scale, (e - s) / scale))
        # compute over comm: a transfer compute hides is not time the rank waited
        for kind in ("comm", "forward", "backward", "optimizer"):
            if kind in by_kind:
                ax.broken_barh(by_kind[kind], (y - 0.4, 0.8), color=COLORS[kind])
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, longest / scale)
    ax.set_xlabel(f"{clock} ({unit})")
    ax.set_title(title, fontsize=10)


def plot_simulated_and_measured(directory, step: int = -1, width: float = 12.0) -> Figure:
    """One step of a traced torch-engine run: simulated clock left, wall clock right."""
    directory = Path(directory)
    simulated = trace_rows(read_traces(directory / "simulated"), step)
    measured = trace_rows(read_traces(directory), step)
    n = len(measured)
    fig = Figure(figsize=(width, 1.6 + 0.45 * n), layout="constrained")
    left, right = fig.subplots(1, 2)
    _panel(left, simulated, "simulated clock (the ledgers' GPUs)", "simulated time")
    _panel(right, measured, "measured: torch.distributed processes, gloo", "wall time")
    kinds = ["forward", "backward", "optimizer", "comm", "idle"]
    fig.legend([Patch(color=COLORS[k]) for k in kinds], kinds, loc="outside lower center",
               ncol=len(kinds), frameon=False, fontsize=8)
    return fig
