"""The Gantt chart of a run's timelines: one row per rank, a bar per event in its kind's
colour at its simulated time, micro-batch labels, the bubble in the title, a PNG."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure

from minipar import distributed as dist
from minipar.distributed.clock import TimelineEvent
from minipar.viz.timeline import COLORS, WEIGHT_COLOR, plot_timeline

# Two ranks, in seconds: rank 1 waits 1 s, so the run is 3 s and 2 of 6 rank-seconds idle.
TIMELINES = [
    [TimelineEvent("forward", 0.0, 1.0, "F0"), TimelineEvent("backward", 1.0, 3.0, "B0")],
    [TimelineEvent("idle", 0.0, 1.0), TimelineEvent("comm", 1.0, 1.5, "recv <-0"),
     TimelineEvent("forward", 1.5, 2.0, "F0")],
]


def bars(fig: Figure):
    """(row, colour hex, start, end) of every bar drawn, sorted."""
    (ax,) = fig.axes
    found = []
    for collection in ax.collections:
        colors = collection.get_facecolor()
        for i, path in enumerate(collection.get_paths()):
            x, y = path.vertices[:, 0], path.vertices[:, 1]
            color = to_hex(colors[i % len(colors)])
            found.append((round(float(y.mean())), color, float(x.min()), float(x.max())))
    return sorted(found)


def test_one_row_per_rank_and_one_bar_per_event():
    fig = plot_timeline(TIMELINES)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top
    assert "(s)" in ax.get_xlabel()
    idle, forward, backward, comm = (COLORS[k] for k in ("idle", "forward", "backward", "comm"))
    assert bars(fig) == sorted([
        (0, idle, 0.0, 3.0), (0, forward, 0.0, 1.0), (0, backward, 1.0, 3.0),
        (1, idle, 0.0, 3.0), (1, comm, 1.0, 1.5), (1, forward, 1.5, 2.0),
    ])
    assert {t.get_text() for t in ax.texts} == {"F0", "B0"}  # comm labels are not written


def test_title_reports_the_idle_share_and_json_style_events_work():
    as_dicts = [[{"kind": e.kind, "start": e.start, "end": e.end, "label": e.label} for e in t]
                for t in TIMELINES]
    fig = plot_timeline(as_dicts)
    assert "33.3%" in fig.axes[0].get_title()  # 2 idle rank-seconds of 6
    assert plot_timeline(as_dicts, title="1F1B").axes[0].get_title() == "1F1B"


def test_a_window_zooms_and_units_follow_the_scale():
    micro = [[TimelineEvent(e.kind, e.start * 1e-6, e.end * 1e-6, e.label) for e in t]
             for t in TIMELINES]
    fig = plot_timeline(micro, start=1e-6, end=2e-6, rank_labels=["stage 0", "stage 1"])
    (ax,) = fig.axes
    assert "(ns)" in ax.get_xlabel() and ax.get_xlim() == pytest.approx((0.0, 1000.0))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert (0, COLORS["backward"], 0.0, pytest.approx(1000.0)) in bars(fig)


def test_later_model_chunks_are_lighter():
    fig = plot_timeline([[TimelineEvent("forward", 0.0, 1.0, "F0"),
                          TimelineEvent("forward", 1.0, 2.0, "F0.1")]])
    colors = {start: color for _, color, start, _ in bars(fig) if color != COLORS["idle"]}
    dark, light = np.array(to_rgb(colors[0.0])), np.array(to_rgb(colors[1.0]))
    assert colors[0.0] == COLORS["forward"] and np.all(light > dark)


def test_a_split_backward_draws_w_apart_with_its_own_legend_entry():
    """ZB schedules: I keeps the backward colour, W (weight gradients) gets its own."""
    split = [[TimelineEvent("forward", 0.0, 1.0, "F0"), TimelineEvent("backward", 1.0, 2.0, "I0"),
              TimelineEvent("backward", 2.0, 3.0, "W0")]]
    fig = plot_timeline(split)
    colors = {start: color for _, color, start, _ in bars(fig) if color != COLORS["idle"]}
    assert colors[1.0] == COLORS["backward"] and colors[2.0] == WEIGHT_COLOR
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "backward weight (W)" in legend
    plain = [t.get_text() for t in plot_timeline(TIMELINES).legends[0].get_texts()]
    assert "backward weight (W)" not in plain


def test_a_real_run_saves_a_png(tmp_path):
    def worker():
        device = dist.get_device()
        with dist.timeline_label("F0"):
            device.compute(1e12 * (1 + dist.get_rank()), "forward")
        dist.barrier()

    _, devices = dist.launch(worker, 2, device=dist.DeviceProfile(flops=1e12),
                             return_devices=True)
    path = tmp_path / "timeline.png"
    plot_timeline([d.clock.events for d in devices]).savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="no timelines"):
        plot_timeline([])
    with pytest.raises(ValueError, match="1 rank labels for 2 ranks"):
        plot_timeline(TIMELINES, rank_labels=["a"])


def test_a_micro_batch_cut_by_tensor_parallel_all_reduces_gets_one_label():
    """Forward of micro-batch 0 interrupted twice by an all-reduce: three blue slivers,
    one "F0" label, centred on the whole span."""
    row = [TimelineEvent("forward", 0.0, 1.0, "F0"), TimelineEvent("comm", 1.0, 1.2, "ar"),
           TimelineEvent("forward", 1.2, 2.0, "F0"), TimelineEvent("comm", 2.0, 2.2, "ar"),
           TimelineEvent("forward", 2.2, 3.0, "F0"), TimelineEvent("backward", 3.0, 4.0, "B0")]
    (ax,) = plot_timeline([row]).axes
    labels = [(t.get_text(), t.get_position()[0]) for t in ax.texts]
    assert labels == [("F0", pytest.approx(1.5)), ("B0", pytest.approx(3.5))]


def test_the_legend_names_only_the_optional_kinds_that_are_drawn():
    def legend(timelines):
        return [t.get_text() for t in plot_timeline(timelines).legends[0].get_texts()]

    assert legend(TIMELINES) == ["forward", "backward", "comm", "idle"]  # no optimizer
    compute_only = [[TimelineEvent("forward", 0.0, 1.0, "F0"),
                     TimelineEvent("backward", 1.0, 3.0, "B0")]]
    assert legend(compute_only) == ["forward", "backward", "idle"]  # a pipeline step alone
    stepped = [compute_only[0] + [TimelineEvent("optimizer", 3.0, 3.5)]]
    assert legend(stepped) == ["forward", "backward", "optimizer", "idle"]
