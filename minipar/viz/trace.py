"""A picture of a profiler trace, laid out the way Perfetto lays out a multi-rank job.

    from minipar.distributed import read_traces
    fig = plot_trace(read_traces("trace/"), step=1)     # the second ProfilerStep
    fig.savefig("trace.png")

Drawn from the trace files themselves (rank<N>.json, minipar.distributed.trace), not from
the report: one track per stream of every rank (stream 7 compute, one per communicator's
nccl kernels), the arrows of the send -> recv flow events between pipeline stages, the
ProfilerStep annotation and the memory counter of each rank below. It is minipar's own
drawing for notebooks and docs where no trace viewer runs; open merged/all_ranks.json in
Perfetto UI (ui.perfetto.dev) for the real, zoomable thing.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minipar.distributed.trace import COMPUTE_STREAM
from minipar.viz.timeline import COLORS, TIME_UNITS

GROUP_COLORS = {"tp": "#c03d3e", "dp": "#8c5fb5", "pp": "#2b9e9e", "other": "#7f7f7f"}
US = 1e-6


def _step_window(traces: list[dict], step: int | None) -> tuple[float, float]:
    """[start, end] in seconds: every rank's ProfilerStep#step (or the whole trace)."""
    spans = []
    for trace in traces:
        for e in trace["traceEvents"]:
            name = e.get("name", "")
            if e.get("cat") == "user_annotation" and name.startswith("ProfilerStep#"):
                if step is None or int(name.split("#")[1]) == step:
                    spans.append((e["ts"] * US, (e["ts"] + e["dur"]) * US))
    if not spans:
        raise ValueError(f"no ProfilerStep#{step} in these traces")
    return min(s for s, _ in spans), max(e for _, e in spans)


def plot_trace(traces: list[dict], step: int | None = None, ranks=None,
               title: str | None = None, memory: bool = True) -> Figure:
    """Tracks of every rank's streams within one step (default: the whole run); `ranks`
    picks some ranks (default: all; arrows to ranks left out are not drawn)."""
    start, end = _step_window(traces, step)
    if ranks is not None:
        traces = [t for t in traces if t["distributedInfo"]["rank"] in set(ranks)]
    scale_name, scale = next((n, s) for n, s in TIME_UNITS if end - start >= 2 * s)
    tracks: list[tuple[int, int]] = []  # (rank, stream), top to bottom
    for trace in traces:
        rank = trace["distributedInfo"]["rank"]
        streams = sorted({e["args"]["stream"] for e in trace["traceEvents"]
                          if e.get("cat") == "kernel"})
        tracks += [(rank, s) for s in streams]
    row = {track: i for i, track in enumerate(tracks)}
    fig = Figure(figsize=(11, 0.22 * len(tracks) + (2.8 if memory else 1.2)),
                 layout="constrained")
    if memory:
        grid = fig.add_gridspec(2, 1, height_ratios=[0.22 * len(tracks), 1.6])
        ax, mem_ax = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    else:
        ax, mem_ax = fig.add_subplot(), None
    flows: dict[int, dict] = {}
    bars: dict[tuple[int, str], list] = {}  # (track, colour) -> spans: one collection each
    labels = []
    for trace in traces:
        rank = trace["distributedInfo"]["rank"]
        for e in trace["traceEvents"]:
            if e.get("cat") == "kernel":
                s, t = e["ts"] * US, (e["ts"] + e["dur"]) * US
                if t < start or s > end:
                    continue
                args = e["args"]
                y = row[(rank, args["stream"])]
                if args["stream"] == COMPUTE_STREAM:
                    color = COLORS[args["kind"]]
                else:
                    color = GROUP_COLORS[args["group"]]
                bars.setdefault((y, color), []).append(((s - start) / scale, (t - s) / scale))
            elif e.get("ph") in ("s", "f") and start <= e["ts"] * US <= end:
                # both ends of an arrow share the flow id, in two ranks' files
                flows.setdefault(e["id"], {})[e["ph"]] = (
                    (e["ts"] * US - start) / scale, row[(rank, e["tid"])])
        for r, stream in tracks:
            if r == rank:
                kind = "compute" if stream == COMPUTE_STREAM else next(
                    e["args"]["group"] for e in trace["traceEvents"]
                    if e.get("cat") == "kernel" and e["args"]["stream"] == stream)
                labels.append(f"rank {rank} {kind} (stream {stream})")
    for (y, color), spans in bars.items():
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color, linewidth=0)
    for ends in flows.values():
        if "s" in ends and "f" in ends:
            (x0, y0), (x1, y1) = ends["s"], ends["f"]
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.7})
    ax.set_yticks(range(len(tracks)), labels, fontsize=7)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(0, (end - start) / scale)
    ax.set_xlabel(f"simulated time ({scale_name}) from the start of "
                  + ("the run" if step is None else f"ProfilerStep#{step}"))
    ax.set_title(title or f"trace of {len(traces)} rank(s): one track per stream, "
                 "arrows = send -> recv flows", pad=18)
    legend = [Patch(color=COLORS[k], label=k) for k in ("forward", "backward", "optimizer")]
    legend += [Patch(color=c, label=f"nccl {g}") for g, c in GROUP_COLORS.items()
               if any(g in label for label in labels)]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7,
              ncol=len(legend), frameon=False)
    if mem_ax is not None:
        for trace in traces:
            points = [(e["ts"] * US, sum(e["args"].values())) for e in trace["traceEvents"]
                      if e.get("ph") == "C"]
            xs = [(t - start) / scale for t, _ in points]
            mem_ax.step(xs, [b / 2**20 for _, b in points], where="post", lw=0.8,
                        label=f"rank {trace['distributedInfo']['rank']}")
        mem_ax.set_xlim(0, (end - start) / scale)
        mem_ax.set_ylabel("MiB held")
        mem_ax.set_title("memory counter (all categories) per rank", fontsize=9)
        mem_ax.legend(fontsize=6, ncol=8, loc="upper left")
    return fig
