"""The browser and matplotlib are given the same data: what an explorer sends to the
browser (its PictureView's pictures) is what its matplotlib figures are drawn from, and a
picture drawn from the summary an explorer keeps of a run is the one drawn from the
whole run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("anywidget")

from minipar.train import TrainConfig, train  # noqa: E402
from minipar.viz import pictures  # noqa: E402
from minipar.viz.memory import memory_picture  # noqa: E402
from minipar.viz.runs import (  # noqa: E402
    pipeline_step,
    pipeline_summary,
    summary_report,
    train_summary,
)
from minipar.viz.sharding import (  # noqa: E402
    holdings,
    holdings_from_summary,
    holdings_summary,
)
from minipar.viz.timeline import timeline_picture  # noqa: E402
from minipar.viz.traffic import sent_picture, traffic_picture  # noqa: E402
from minipar.viz.widgets import (  # noqa: E402
    MemoryExplorer,
    PipelineExplorer,
    ShardingExplorer,
    TrafficExplorer,
)

SMALL = TrainConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, micro_batch_size=2, steps=1)


def as_sent(data):
    """What goes over the wire: the widget's JSON."""
    return json.loads(json.dumps(data, allow_nan=False))


@pytest.mark.parametrize("make", [
    lambda: MemoryExplorer(SMALL, dp=2, zero=3, offload_optimizer="cpu"),
    lambda: TrafficExplorer(SMALL, dp=2, tp=2, pp=1, zero=1, grad_accum_steps=1, by="op"),
    lambda: PipelineExplorer(schedule="interleaved", pp=2, micro_batches=4,
                             virtual_stages=2),
    lambda: ShardingExplorer(SMALL, dp=2, tp=2, pp=1, zero=2, kind="grads"),
], ids=["memory", "traffic", "pipeline", "sharding"])
def test_the_browser_is_given_what_the_figures_are_drawn_from(make, monkeypatch):
    explorer = make()
    assert explorer.error is None
    given = []
    for name, drawer in list(pictures.DRAWERS.items()):
        monkeypatch.setitem(pictures.DRAWERS, name, lambda picture, drawer=drawer, **kw:
                            given.append(as_sent(picture)) or drawer(picture, **kw))
    figures = explorer.figures
    assert len(figures) == len(explorer.view.pictures) >= 1
    assert given == as_sent(explorer.view.pictures)
    # and a change sends the new setting's data, which the figures follow
    name = "dp" if "dp" in explorer.controls else "micro_batches"
    explorer.controls[name].value = 1 if explorer.values()[name] != 1 else 2
    given.clear()
    explorer.figures  # noqa: B018 - drawn for what they are given
    assert given == as_sent(explorer.view.pictures) and explorer.view.setting


def test_a_training_summary_draws_the_pictures_the_whole_report_draws():
    config = SMALL.replace(dp=2, tp=2, zero=1, grad_accum_steps=2)
    report = train(config)
    kept = summary_report(as_sent(train_summary(report)), config)  # (stored as JSON)
    assert as_sent(memory_picture(kept)) == as_sent(memory_picture(report))
    for by in ("group", "op"):
        assert as_sent(sent_picture(kept, by=by)) == as_sent(sent_picture(report, by=by))
    assert as_sent(traffic_picture(kept, gpus_per_node=2)) == as_sent(
        traffic_picture(report, gpus_per_node=2))
    offloaded = SMALL.replace(dp=2, zero=3, offload_optimizer="nvme", offload_param="cpu")
    report = train(offloaded)
    kept = summary_report(as_sent(train_summary(report)), offloaded)
    assert as_sent(memory_picture(kept)) == as_sent(memory_picture(report))


def test_a_pipeline_summary_draws_the_timeline_the_step_draws():
    step = pipeline_step("zb-v", 2, 4, 2)
    kept = as_sent(pipeline_summary(step))
    assert as_sent(timeline_picture(kept["timelines"])) == as_sent(
        timeline_picture(step["timelines"]))
    assert kept["in_flight"] == list(step["in_flight"])


def test_a_holdings_summary_gives_back_every_mask():
    held = holdings(dp=2, tp=2, pp=1, zero=3, config=SMALL)
    again = holdings_from_summary(as_sent(holdings_summary(held)), SMALL)
    for before, after in zip(held.masks, again.masks, strict=True):
        assert before.keys() == after.keys()
        for kind in before:
            assert before[kind].keys() == after[kind].keys()
            assert all((before[kind][n] == after[kind][n]).all() for n in before[kind])
    assert holdings_summary(again) == holdings_summary(held)
