"""The explorers, driven headless: set a control's value, the callback runs at once, and
the picture shows the measured numbers (checked here against the definitions: bytes per
parameter, ZeRO's 1/N, the schedules' micro-batches in flight)."""

from __future__ import annotations

import html

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

pytest.importorskip("ipywidgets")

from minipar.nn.gpt import parameter_shapes  # noqa: E402
from minipar.train import TrainConfig  # noqa: E402
from minipar.train.data import make_stream  # noqa: E402
from minipar.train.report import MEMORY_CATEGORIES  # noqa: E402
from minipar.viz import lattice, widgets  # noqa: E402
from minipar.viz.runs import RunCache
from minipar.viz.widgets import MemoryExplorer, PipelineExplorer, ShardingExplorer, TrafficExplorer

SMALL = TrainConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, micro_batch_size=2, steps=1)


def psi(config: TrainConfig) -> int:
    from minipar.train.config import gpt_config

    vocab = make_stream(config.data).vocab_size
    return sum(int(np.prod(s)) for s in parameter_shapes(gpt_config(config, vocab)).values())


def bar_heights(ax, category):
    """Heights of one category's bars in minipar.viz.memory.plot_memory's stacked bars
    (one rectangle per rank and category, drawn rank by rank in MEMORY_CATEGORIES
    order)."""
    heights = np.array([bar.get_height() for c in ax.containers for bar in c])
    per_rank = heights.reshape(-1, len(MEMORY_CATEGORIES))
    return per_rank[:, MEMORY_CATEGORIES.index(category)]


def byte_scale(ax) -> int:
    """Bytes per unit of the y axis, read off its label ("... (KiB)")."""
    return {"B": 1, "KiB": 2**10, "MiB": 2**20}[ax.get_ylabel().split("(")[1][:-1]]


@pytest.fixture
def counted_runs(monkeypatch):
    """Count the training runs the explorers start."""
    calls = []
    real = lattice.train_report

    def counting(config, device=None):
        calls.append(config)
        return real(config, device)

    monkeypatch.setattr(lattice, "train_report", counting)
    return calls


# ------------------------------------------------------------------ memory
def test_memory_explorer_bars_are_the_measured_bytes_per_parameter(counted_runs):
    explorer = MemoryExplorer(SMALL, dp=2, zero=0, precision="fp32")
    assert explorer.error is None and explorer.draws == 1
    assert explorer.view.pictures == explorer.pictures  # the data the browser draws
    (ax, *_) = explorer.figure.axes
    n_params = psi(SMALL)
    # fp32 data parallelism: 4 bytes of weights per parameter on every replica, 8 of
    # Adam's m and v
    assert np.allclose(bar_heights(ax, "params") * byte_scale(ax), 4 * n_params)
    assert np.allclose(bar_heights(ax, "optimizer") * byte_scale(ax), 8 * n_params)

    explorer.controls["zero"].value = 3  # the callback fires synchronously
    assert explorer.draws == 2 and len(counted_runs) == 2
    (ax, *_) = explorer.figure.axes
    # ZeRO-3 over 2 ranks: half the weights each (up to the padding of each flat unit)
    assert np.allclose(bar_heights(ax, "params") * byte_scale(ax), 4 * n_params / 2,
                       rtol=1e-3)
    assert "ZeRO-3" in ax.get_title()


def test_memory_explorer_caches_runs_and_pictures(counted_runs):
    cache = RunCache()
    explorer = MemoryExplorer(SMALL, cache=cache, dp=2)
    first = explorer.view.pictures
    explorer.controls["zero"].value = 2
    explorer.controls["zero"].value = 0  # back: no new run, the same picture
    assert len(counted_runs) == 2
    assert explorer.view.pictures == first
    # another explorer on the same cache reuses the runs
    MemoryExplorer(SMALL, cache=cache, dp=2)
    assert len(counted_runs) == 2


def test_set_changes_several_controls_with_one_redraw(counted_runs):
    explorer = MemoryExplorer(SMALL, dp=1)
    explorer.set(dp=4, zero=1, precision="bf16-mixed")
    assert explorer.draws == 2 and len(counted_runs) == 2
    assert counted_runs[-1].dp == 4 and counted_runs[-1].zero == 1
    with pytest.raises(KeyError, match="no control"):
        explorer.set(stage=2)


def test_a_layout_that_cannot_run_is_reported_not_raised():
    explorer = MemoryExplorer(SMALL.replace(n_head=2), dp=1)
    drawn = explorer.pictures
    explorer.controls["tp"].value = 4  # 2 heads cannot split over 4 ranks
    assert explorer.error is not None and "tp" in explorer.error
    assert "cannot run" in explorer.status.value
    assert explorer.pictures is drawn  # the last good picture stays


# ------------------------------------------------------------------ sharding
def panel_titles(fig) -> list[str]:
    """The per-rank panel titles of minipar.viz.sharding.plot_sharding ("r0 (...): 50%")."""
    return [text.get_text() for text in fig.axes[1].texts]


def test_sharding_explorer_draws_one_panel_per_rank_with_the_share_held():
    explorer = ShardingExplorer(dp=2, tp=1, pp=1, zero=0, kind="optimizer",
                                tensor="h.0.mlp.c_fc.weight")
    assert panel_titles(explorer.figure) == ["r0 (dp0 pp0 tp0): 100%",
                                             "r1 (dp1 pp0 tp0): 100%"]
    explorer.controls["zero"].value = 1  # optimizer state sharded over the 2 DP ranks
    held = explorer.holdings(2, 1, 1, 1)
    total = [held.masks[r]["optimizer"].get("h.0.mlp.c_fc.weight") for r in range(2)]
    assert sum(int(m.sum()) if m is not None else 0 for m in total) == 64 * 256
    # each rank's title is the share of c_fc (64 x 256) it holds, read off its mask
    shares = [title.rsplit(" ", 1)[1] for title in panel_titles(explorer.figure)]
    drawn = [np.asarray(image.get_array()) for image in explorer.figure.axes[1].images]
    assert shares == [f"{(d > 0.5).sum() / (64 * 256):.0%}" for d in drawn]
    assert sum((d > 0.5).sum() for d in drawn) == 64 * 256  # ZeRO-1 loses nothing
    explorer.controls["kind"].value = "params"  # ZeRO-1 keeps whole weights
    assert all(title.endswith("100%") for title in panel_titles(explorer.figure))


def test_sharding_explorer_refuses_more_than_16_ranks():
    explorer = ShardingExplorer(dp=4, tp=4, pp=1)
    draws = explorer.draws
    explorer.controls["pp"].value = 2
    assert explorer.error is not None and "16" in explorer.error
    assert explorer.draws == draws
    # the last picture is another layout's: hidden while the controls say pp=2 ...
    assert not explorer.view.visible
    explorer.controls["pp"].value = 1  # ... and shown again with a layout that runs
    assert explorer.error is None and explorer.view.visible


# ------------------------------------------------------------------ pipeline
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_explorer_shows_the_schedules_activations_in_flight(schedule):
    p, m = 4, 6
    explorer = PipelineExplorer(schedule=schedule, pp=p, micro_batches=m)
    timeline, extra = explorer.figures
    assert [t.get_text() for t in timeline.axes[0].get_yticklabels()] == \
        [f"rank {r}" for r in range(p)]
    in_flight = [bar.get_height() for bar in extra.axes[0].patches]
    # GPipe keeps all m forwards before any backward; 1F1B at most p - s on stage s
    # (Narayanan et al. 2021, section 2.2.1).
    expected = [m] * p if schedule == "gpipe" else [min(p - s, m) for s in range(p)]
    assert in_flight == expected
    # measured activation bytes follow the same ratio (same micro-batch size per stage)
    measured = [bar.get_height() for bar in extra.axes[1].patches]
    assert measured[0] > 0
    if schedule == "gpipe":
        assert measured[0] == pytest.approx(measured[1], rel=0.05)
    else:
        assert measured[0] / measured[2] == pytest.approx(p / (p - 2), rel=0.05)


def test_pipeline_explorer_bubble_shrinks_with_m_and_is_in_the_title():
    explorer = PipelineExplorer(schedule="1f1b", pp=4, micro_batches=4)
    first = explorer.figure.axes[0].get_title()
    explorer.controls["micro_batches"].value = 16
    second = explorer.figure.axes[0].get_title()
    bubbles = [float(title.split("bubble ")[1].split("%")[0]) for title in (first, second)]
    assert bubbles[1] < bubbles[0]
    assert "m=16" in second


def test_pipeline_explorer_explains_an_impossible_interleaving():
    explorer = PipelineExplorer(schedule="1f1b", pp=4, micro_batches=6)
    explorer.set(schedule="interleaved", virtual_stages=2)
    assert "multiple" in explorer.error  # m must be a multiple of p (Megatron's rule)
    explorer.controls["micro_batches"].value = 8
    assert explorer.error is None
    assert "v=2" in explorer.figure.axes[0].get_title()


# ------------------------------------------------------------------ traffic
def test_one_device_has_no_traffic_to_show_and_says_so_in_the_readers_words():
    # it ran and said "cannot run this layout: plot_traffic: no rank sent any bytes"
    explorer = TrafficExplorer(SMALL, dp=2, tp=1, pp=1, grad_accum_steps=1)
    explorer.set(dp=1)
    assert explorer.status.value.startswith(
        "<span style='color:#b00020'>nothing to show with &quot;dp&quot; = 1: one device")
    assert "plot_traffic" not in explorer.status.value
    assert not explorer.view.visible
    explorer.set(dp=2)
    assert explorer.error is None


def test_traffic_explorer_matrix_rows_are_the_bytes_each_rank_sent():
    explorer = TrafficExplorer(SMALL, dp=2, tp=1, pp=1, zero=0, grad_accum_steps=1,
                               gpus_per_node=2)
    assert explorer.error is None
    report = explorer.run(dp=2, tp=1, pp=1, zero=0, grad_accum_steps=1, gpus_per_node=2)
    matrix = widgets.traffic_of(report)
    assert matrix.shape == (2, 2)
    assert list(matrix.sum(axis=1)) == [r["comm"]["sent_bytes"] for r in report.ranks]
    # DP all-reduce of fp32 gradients, ring over 2 ranks: 2(n-1)/n x 4 Ψ = 4 Ψ each way
    assert matrix[0, 1] >= 4 * psi(SMALL)
    heatmaps, bars = explorer.figures
    # one step: the dp heatmap is the matrix; the bars are each rank's row sum
    (dp_map,) = [ax for ax in heatmaps.axes if ax.get_title().startswith("data parallel")]
    assert np.allclose(dp_map.images[0].get_array().filled(0), matrix)
    (ax,) = bars.axes
    sent = np.sum([[c[i].get_height() for i in range(2)] for c in ax.containers], axis=0)
    assert np.allclose(sent * byte_scale(ax), matrix.sum(axis=1))


def test_only_the_data_parallel_bytes_cross_nodes_when_tp_fits_in_a_node():
    # dp=2 x tp=2 on nodes of 2 GPUs: TP groups [0,1] [2,3] stay inside a node, the DP
    # groups [0,2] [1,3] cross (DeviceMesh puts tp fastest, as Megatron-LM does).
    explorer = TrafficExplorer(SMALL, dp=2, tp=2, pp=1, zero=1, grad_accum_steps=1,
                               gpus_per_node=2)
    report = explorer.run(dp=2, tp=2, pp=1, zero=1, grad_accum_steps=1, gpus_per_node=2)
    matrix = widgets.traffic_of(report)
    dp_bytes = sum(r["comm"]["by_group"]["dp"] for r in report.ranks)
    assert dp_bytes > 0
    assert widgets.cross_node_bytes(matrix, 2) == dp_bytes
    assert "crosses a node boundary" in explorer.status.value
    assert explorer.status.value.startswith(  # the layout, so that every change shows
        f"dp={explorer.values()['dp']} tp={explorer.values()['tp']} ")
    explorer.controls["by"].value = "op"  # same run, bars split by collective
    labels = {c.get_label() for c in explorer.figures[1].axes[0].containers}
    assert {"all_reduce", "reduce_scatter", "all_gather"} <= labels


# ------------------------------------------------------------------ drawing
@pytest.mark.parametrize("make", [
    lambda: MemoryExplorer(SMALL, dp=2, tp=2, pp=2, zero=1),
    lambda: MemoryExplorer(SMALL, dp=8, zero=3, recompute_granularity="full"),  # long title
    lambda: PipelineExplorer(schedule="interleaved", pp=4, micro_batches=8, virtual_stages=2),
    lambda: TrafficExplorer(SMALL, dp=2, tp=2, pp=2, zero=1),
    lambda: ShardingExplorer(dp=4, tp=4, pp=1),
], ids=["memory", "memory-long-title", "pipeline", "traffic", "sharding"])
def test_every_label_stays_inside_the_picture(make):
    # The explorers' figures place their axes with margins of fixed inches or a
    # constrained layout; nothing drawn may fall outside the figure.
    explorer = make()
    assert explorer.error is None
    for fig in explorer.figures:
        FigureCanvasAgg(fig).draw()  # (a constrained layout places its axes as it draws)
        renderer = fig.canvas.get_renderer()
        drawn = fig.get_tightbbox(renderer)  # inches, everything that was drawn
        width, height = fig.get_size_inches()
        assert drawn.x0 >= -0.02 and drawn.y0 >= -0.02, drawn
        assert drawn.x1 <= width + 0.02 and drawn.y1 <= height + 0.02, drawn


def test_memory_explorer_shows_the_offload_tiers_behind_each_gpu(counted_runs):
    """Offloading the optimizer moves its bar from the GPU panel to the host panel."""
    explorer = MemoryExplorer(SMALL, dp=2, zero=1, precision="bf16-mixed")
    (ax,) = explorer.figure.axes
    on_gpu = bar_heights(ax, "optimizer") * byte_scale(ax)
    explorer.controls["offload_optimizer"].value = "cpu"
    assert explorer.error is None
    gpu_ax, host_ax = explorer.figure.axes
    assert np.allclose(bar_heights(gpu_ax, "optimizer"), 0)
    assert np.allclose(bar_heights(host_ax, "optimizer") * byte_scale(host_ax), on_gpu)
    assert "host memory" in explorer.status.value and "PCIe" in explorer.status.value
    explorer.controls["offload_param"].value = "cpu"  # ZeRO-1 has no parameter shard
    assert explorer.error is not None and "--zero 3" in explorer.error


def test_a_traffic_run_serves_every_gpus_per_node_and_draws_that_settings_nodes(
        counted_runs):
    from minipar.train import train

    layout = dict(dp=2, tp=2, pp=1, zero=1, grad_accum_steps=1)
    # the premise, measured: where a node ends changes no byte sent to any rank
    on_two, on_four = (train(SMALL.replace(**layout, gpus_per_node=g)) for g in (2, 4))
    assert on_two.traffic == on_four.traffic
    assert [r["comm"] for r in on_two.ranks] == [r["comm"] for r in on_four.ranks]
    explorer = TrafficExplorer(SMALL, **layout, gpus_per_node=4)
    runs = len(counted_runs)
    explorer.controls["gpus_per_node"].value = 2
    assert len(counted_runs) == runs  # the same measured run
    fresh = TrafficExplorer(SMALL, **layout, gpus_per_node=2)  # its own run on 2 per node
    assert len(counted_runs) == runs + 1
    assert explorer.pictures == fresh.pictures
    assert explorer.status.value == fresh.status.value


def test_a_traffic_setting_measured_in_the_background_is_the_one_a_direct_run_gives(
        counted_runs):
    class TwoSettings(TrafficExplorer):  # a lattice of two settings, to stay quick
        def lattice(self):
            return [self.measured({**self.values(), "zero": zero}) for zero in (0, 2)]

    layout = dict(dp=2, tp=1, pp=2, grad_accum_steps=2, gpus_per_node=2)
    explorer = TwoSettings(SMALL, prefetch=True, **layout, zero=1)
    assert explorer.worker.wait_idle(60)
    runs = len(counted_runs)
    explorer.controls["zero"].value = 0
    assert len(counted_runs) == runs  # measured while the reader looked
    fresh = TrafficExplorer(SMALL, **layout, zero=0)
    assert explorer.pictures == fresh.pictures
    explorer.worker.cancel(explorer)


@pytest.mark.parametrize("explorer_class", [MemoryExplorer, TrafficExplorer])
def test_the_lattice_holds_layouts_up_to_32_ranks_that_the_rules_let_run(explorer_class):
    explorer = explorer_class(SMALL, dp=1, tp=1, pp=1)
    settings = explorer.lattice()
    worlds = {s["dp"] * s["tp"] * s["pp"] for s in settings}
    assert max(worlds) == 32 and 1 in worlds
    assert not any(s["zero"] >= 2 and s["pp"] > 1 for s in settings)  # refused: not in it
    layouts = {(s["dp"], s["tp"], s["pp"], s["zero"], s["precision"]) for s in settings}
    assert (8, 4, 1, 1, "bf16-mixed") in layouts and (8, 2, 2, 0, "fp32") in layouts


def test_a_refusal_speaks_of_the_controls_not_of_command_line_flags():
    explorer = PipelineExplorer(pp=8, micro_batches=9)
    explorer.controls["schedule"].value = "interleaved"  # needs v >= 2
    assert "--virtual-stages 2" in explorer.error  # the rules' own words, as an API
    assert "&quot;v (chunks)&quot; = 2" in explorer.status.value  # the reader's
    explorer.controls["virtual_stages"].value = 2  # m must be a multiple of p
    assert "&quot;m (micro-batches)&quot; = 8 or 16" in explorer.status.value
    assert "--" not in explorer.status.value


def test_status_lines_give_one_figure_when_every_rank_has_the_same():
    memory = MemoryExplorer(config=SMALL, prefetch=False, dp=2, zero=0)  # two replicas
    peaks = {r["memory"]["peak_total"] for r in memory.run(**memory.values()).ranks}
    assert len(peaks) == 1
    assert "peak per rank " + widgets.human_bytes(peaks.pop()) + " (" in memory.status.value
    alone = ShardingExplorer(config=SMALL, prefetch=False, dp=1, tp=1, pp=1)
    assert alone.status.value.startswith("1 rank holds 100.0% of the model's optimizer (")
    alone.set(dp=2, pp=2)  # stages of different sizes: a range
    assert " to " in alone.status.value.split(";")[1]


def test_the_status_while_measuring_says_how_many_ranks_run_and_drawing_once_measured():
    explorer = TrafficExplorer(SMALL, dp=2, tp=1, pp=1, zero=0, grad_accum_steps=1)
    shown = explorer.values()
    assert explorer.pending_status({**shown, "tp": 2, "grad_accum_steps": 4}) == (
        "measuring one training step on 4 virtual ranks, 4 micro-batches each ...")
    # measured already (another node size, the same run): nothing to measure
    assert explorer.measurements.known(explorer.measured({**shown, "gpus_per_node": 2}))
    pipeline = PipelineExplorer(schedule="gpipe", pp=2, micro_batches=2)
    assert "gpipe step on 2 stages, 2 micro-batches" in pipeline.pending_status(
        pipeline.values())


@pytest.mark.parametrize("make, refused", [
    (lambda: MemoryExplorer(SMALL, dp=2, zero=0), {"offload_optimizer": "cpu"}),
    (lambda: TrafficExplorer(SMALL, dp=2, tp=1, pp=2, zero=1), {"zero": 3}),
    (lambda: PipelineExplorer(pp=2, micro_batches=4), {"schedule": "interleaved"}),
    (lambda: ShardingExplorer(dp=4, tp=2, pp=2), {"tp": 4}),
])
def test_a_refusal_is_said_at_once_without_a_run(make, refused):
    class Worker:  # records what the explorer asks of the background worker
        def __init__(self):
            self.asked = 0

        def run_now(self, job, key=None, on_wait=None):
            self.asked += 1
            return job()

        def prefetch(self, owner, jobs):
            pass

    explorer = make()
    explorer.worker = worker = Worker()
    explorer.set(**refused)
    assert explorer.error is not None and worker.asked == 0  # the rules, not a run


def test_a_second_refusal_for_the_same_reason_names_the_change_it_answers():
    explorer = MemoryExplorer(SMALL, dp=2, zero=1, offload_optimizer="nvme")  # refused
    explorer.controls["tp"].value = 2  # still refused, for the same reason
    assert 'cannot run this layout with "tp" = 2:' in html.unescape(explorer.status.value)
    first = explorer.status.value
    explorer.controls["dp"].value = 4
    assert explorer.status.value != first and '"dp" = 4' in html.unescape(
        explorer.status.value)


def test_the_pipeline_status_counts_chunk_forwards_as_such_when_interleaved():
    # p 4, m 8, v 2: stage 0 holds up to 10 micro-batch x chunk forwards (more than m / p)
    explorer = PipelineExplorer(schedule="interleaved", pp=4, micro_batches=8,
                                virtual_stages=2)
    assert "micro-batch x chunk forwards" in explorer.status.value
    explorer.set(schedule="1f1b", virtual_stages=1)
    assert "activations of 4 micro-batches at once" in explorer.status.value


def test_a_setting_an_explorer_does_not_offer_is_refused_naming_the_control_and_its_options():
    with pytest.raises(ValueError, match=r"grad_accum_steps \('micro-batches'\) is one of "
                                         r"\[1, 2, 4, 8\], got 3"):
        MemoryExplorer(SMALL, grad_accum_steps=3)
    with pytest.raises(ValueError, match="an integer from 1 to 16, got 40"):
        PipelineExplorer(micro_batches=40)
    with pytest.raises(KeyError, match="has no control 'micro_batches'"):
        TrafficExplorer(SMALL, micro_batches=2)
    explorer = PipelineExplorer()
    with pytest.raises(ValueError, match="is one of"):
        explorer.set(pp=3)
    assert explorer.values()["pp"] == 4  # nothing changed
