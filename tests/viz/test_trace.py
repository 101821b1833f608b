"""The drawing of a trace: a track per stream of every rank, an arrow per send -> recv."""

import numpy as np
import pytest
from matplotlib.patches import FancyArrowPatch

from minipar import distributed as dist
from minipar.distributed.trace import rank_trace
from minipar.viz.trace import plot_trace


def pipeline_worker():
    """Rank 0 computes and sends to rank 1, which computes after receiving (one step)."""
    device = dist.get_device()
    if dist.get_rank() == 0:
        device.compute(4e6, "forward", op="Linear")
        dist.send(np.ones(256, np.float32), 1)
    else:
        dist.recv(0)
        device.compute(4e6, "forward", op="Linear")


@pytest.fixture
def traces():
    _, devices = dist.launch(pipeline_worker, 2, return_devices=True, trace=True)
    end = max(d.clock.now for d in devices)
    return [rank_trace(d, steps=[(0, 0.0, end)]) for d in devices]


def test_one_track_per_stream_and_one_arrow_per_message(traces):
    fig = plot_trace(traces, step=0)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    # send/recv without a group are charged to "other": its communicator's stream is 50
    assert labels == ["rank 0 compute (stream 7)", "rank 0 other (stream 50)",
                      "rank 1 compute (stream 7)", "rank 1 other (stream 50)"]
    kernels = sum(1 for t in traces for e in t["traceEvents"] if e.get("cat") == "kernel")
    assert sum(len(c.get_paths()) for c in ax.collections) == kernels  # a bar per kernel
    arrows = [t for t in ax.texts if isinstance(t.arrow_patch, FancyArrowPatch)]
    assert len(arrows) == 1
    (x0, y0), (x1, y1) = arrows[0].xyann, arrows[0].xy
    assert (y0, y1) == (1, 3) and x0 == x1  # from rank 0's send to rank 1's recv
    assert len(fig.axes) == 2  # the memory counter below


def test_picking_ranks_and_a_missing_step(traces):
    fig = plot_trace(traces, step=0, ranks=[1], memory=False)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][0] == "rank 1 compute (stream 7)"
    with pytest.raises(ValueError, match="ProfilerStep#3"):
        plot_trace(traces, step=3)
