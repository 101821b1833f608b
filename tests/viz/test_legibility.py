"""Every explorer's default view is legible at the size JupyterLab shows it.

JupyterLab stretches an explorer's picture (an `ipywidgets.Image`) to the width of the
output area, whatever its pixels: measured in headless Chromium, JupyterLab 4 at a
1280-pixel window with the file browser open gives 829 px. So the size a reader sees is
    font size in display px = points / 72 * (DISPLAY_WIDTH / figure width in inches),
whatever the PNG's dpi (which only decides how sharp it is). Static figures in the
notebooks (the inline backend, 100 dpi by default) are shown at their own pixels, never
wider than the output area.

Checked from matplotlib's own text extents after a draw: no visible text below MIN_PX
display pixels or off the picture, and no title (axes title, figure title or figure
text) overlapping a legend or another title.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("ipywidgets")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.legend import Legend  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from minipar.train import TrainConfig  # noqa: E402
from minipar.viz import widgets  # noqa: E402
from minipar.viz.memory import plot_memory  # noqa: E402

DISPLAY_WIDTH = 829  # px: JupyterLab 4's output area at a 1280 px window (see above)
MIN_PX = 10  # smallest font size a reader gets, in display pixels
LABEL_GAP_PX = 3  # the least room between two tick labels, in the picture's pixels
INLINE_DPI = 100  # matplotlib-inline's default figure dpi
# a smaller model than the explorers' (the labels depend on the ranks alone), 4 layers for pp 4
SMALL = TrainConfig(n_layer=4, d_model=32, n_head=4, seq_len=16, micro_batch_size=2, steps=1)


def _visible_texts(fig):
    """Every text a draw shows: tick labels of the ticks in view, and all other texts."""
    ticks, drawn = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update((id(tick.label1), id(tick.label2)))
            if ax.get_visible() and ax.axison and axis.get_visible():
                # the ticks a draw shows: those within the view limits
                drawn += [label for tick in axis._update_ticks()
                          for label in (tick.label1, tick.label2)]
    others = [t for t in fig.findobj(Text) if id(t) not in ticks]
    for text in others + drawn:
        if text.get_visible() and text.get_text().strip():
            yield text


def _titles(fig):
    """(what, Text) of every title: axes titles, the suptitle and figure texts."""
    for ax in fig.axes:
        for title in (ax.title, ax._left_title, ax._right_title):
            if title.get_text().strip():
                yield f"title of {ax.get_label() or 'an axes'}", title
    if fig._suptitle is not None and fig._suptitle.get_text().strip():
        yield "figure title", fig._suptitle
    for text in fig.texts:
        if text is not fig._suptitle and text.get_text().strip():
            yield "figure text", text


def _legends(fig):
    yield from fig.legends
    for ax in fig.axes:
        if ax.get_legend() is not None:
            yield ax.get_legend()


def problems(fig, display_width: float | None, tight: bool = False) -> list[str]:
    """What a reader would trip on: text too small or off the picture, titles under
    legends or titles. tight: shown with bbox_inches="tight" (the inline backend's
    default), which grows the picture to hold every text."""
    canvas = fig.canvas if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width_in = fig.get_size_inches()[0]
    # display pixels per point: stretched to the output area, or the figure's own pixels
    per_point = (display_width / width_in / 72 if display_width is not None
                 else fig.dpi / 72 * min(1.0, DISPLAY_WIDTH / (width_in * fig.dpi)))
    found = []
    inside = fig.bbox.padded(2)  # display px of the whole picture (2 px of rounding)
    for text in _visible_texts(fig):
        size = text.get_fontsize() * per_point
        if size < MIN_PX - 1e-9:
            found.append(f"{text.get_text()!r} is {size:.1f} display px (< {MIN_PX})")
        extent = text.get_window_extent(renderer)
        clipped = text.get_clip_on() and text.get_clip_box() is not None
        if not clipped and not tight and not (
                inside.x0 <= extent.x0 and extent.x1 <= inside.x1
                and inside.y0 <= extent.y0 and extent.y1 <= inside.y1):
            found.append(f"{text.get_text()!r} runs off the picture")
    boxes = [(what, t.get_window_extent(renderer)) for what, t in _titles(fig)]
    legends = [(f"legend {[t.get_text() for t in legend.get_texts()][:3]}...",
                legend.get_window_extent(renderer)) for legend in _legends(fig)
               if isinstance(legend, Legend) and legend.get_visible()]
    for (a, box_a), (b, box_b) in itertools.chain(
            itertools.product(boxes, legends), itertools.combinations(boxes, 2)):
        if box_a.overlaps(box_b):
            found.append(f"{a} overlaps {b}")
    for what, box in boxes:  # a title under another axes' tick or axis labels (rows)
        for ax in fig.axes:
            for label in ax.get_xticklabels() + [ax.xaxis.label]:
                if (label.get_visible() and label.get_text().strip() and label.figure
                        and box.overlaps(label.get_window_extent(renderer))):
                    found.append(f"{what} overlaps {label.get_text()!r}")
    for ax in fig.axes:  # neighbouring tick labels of one axis run into each other
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            # at least LABEL_GAP_PX apart: touching labels read as one word
            extents = [t.get_window_extent(renderer).padded(LABEL_GAP_PX / 2) for t in labels]
            for i in range(len(labels) - 1):
                if extents[i].overlaps(extents[i + 1]):
                    found.append(f"tick labels {labels[i].get_text()!r} and "
                                 f"{labels[i + 1].get_text()!r} overlap")
    return found


EXPLORERS = {
    "sharding": lambda cache: widgets.ShardingExplorer(cache=cache),
    "memory": lambda cache: widgets.MemoryExplorer(cache=cache),
    "pipeline": lambda cache: widgets.PipelineExplorer(cache=cache),
    "pipeline-interleaved": lambda cache: widgets.PipelineExplorer(
        cache=cache, schedule="interleaved", virtual_stages=2),
    "traffic": lambda cache: widgets.TrafficExplorer(cache=cache),
}


@pytest.fixture(scope="module")
def cache():
    return widgets.RunCache()


@pytest.mark.parametrize("name", EXPLORERS)
def test_each_explorers_default_view_is_legible_in_jupyterlab(name, cache):
    explorer = EXPLORERS[name](cache)
    assert explorer.error is None
    for fig in explorer.figures:  # (the browser draws SVG: sharp at any width)
        assert problems(fig, DISPLAY_WIDTH) == []


@pytest.mark.parametrize("dp", [2, 4])
def test_the_memory_figure_of_the_notebooks_keeps_its_title_clear_of_the_legend(dp, cache):
    # notebooks 02 (cell 7) and 03 (cell 5) show plot_memory(report) inline
    explorer = widgets.MemoryExplorer(cache=cache, dp=dp, zero=3)
    fig = plot_memory(explorer.run(**explorer.values()))
    fig.set_dpi(INLINE_DPI)
    assert problems(fig, None, tight=True) == []


@pytest.mark.parametrize("layout", [dict(dp=8, tp=2), dict(dp=8, tp=4)])
def test_the_memory_explorers_rank_labels_stay_apart_with_many_ranks(layout, cache):
    explorer = widgets.MemoryExplorer(cache=cache, **layout)
    assert problems(explorer.figure, DISPLAY_WIDTH) == []


@pytest.mark.parametrize("layout", [dict(dp=4, tp=4, pp=1), dict(dp=2, tp=2, pp=4),
                                    dict(dp=8, tp=4, pp=1), dict(dp=8, tp=4, pp=2)])
def test_the_traffic_explorers_rank_labels_stay_apart_with_many_ranks(layout, cache):
    explorer = widgets.TrafficExplorer(SMALL, cache=cache, grad_accum_steps=1, **layout)
    assert explorer.error is None
    for fig in explorer.figures:  # the matrices and the bars, 16 to 64 ranks
        assert problems(fig, DISPLAY_WIDTH) == []


@pytest.mark.parametrize("layout", [
    dict(dp=4, zero=1, offload_optimizer="cpu"),
    dict(dp=8, zero=3, offload_optimizer="nvme", offload_param="cpu"),  # host and NVMe
    dict(dp=8, tp=4, zero=3, offload_optimizer="nvme", offload_param="cpu")])  # 32, both
def test_the_memory_explorers_offload_tiers_are_legible(layout, cache):
    explorer = widgets.MemoryExplorer(SMALL, cache=cache, **layout)
    assert explorer.error is None and len(explorer.figure.axes) == 2  # GPU, then tiers
    assert problems(explorer.figure, DISPLAY_WIDTH) == []


def test_the_offloaded_memory_figure_of_notebook_03_is_legible_inline(cache):
    # notebook 03 shows plot_memory of a ZeRO-3 run with everything on NVMe, inline
    explorer = widgets.MemoryExplorer(cache=cache, dp=4, zero=3, offload_optimizer="nvme",
                                      offload_param="nvme")
    fig = plot_memory(explorer.run(**explorer.values()))
    fig.set_dpi(INLINE_DPI)
    assert problems(fig, None, tight=True) == []


def test_the_pipeline_explorers_stage_labels_stay_apart_with_8_stages(cache):
    explorer = widgets.PipelineExplorer(cache=cache, pp=8, micro_batches=8)
    for fig in explorer.figures:
        assert problems(fig, DISPLAY_WIDTH) == []


def test_the_check_itself_finds_small_text_and_a_title_under_a_legend():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 2))
    ax = fig.subplots()
    ax.plot([0, 1], label="a long legend entry")
    ax.set_title("a title " * 12, fontsize=6)
    fig.legend(loc="upper center")
    fig.text(0.95, 0.5, "a label that runs past the right edge")
    ax.set_xticks(range(60), [f"rank {i}" for i in range(60)], fontsize=8)
    found = problems(fig, DISPLAY_WIDTH)
    assert any("display px" in p for p in found)
    assert any("overlaps legend" in p for p in found)
    assert any("runs off the picture" in p for p in found)
    assert any("tick labels 'rank 0' and 'rank 1' overlap" in p for p in found)


def test_with_host_and_nvme_for_many_ranks_each_label_names_a_rank_under_its_pair(cache):
    explorer = widgets.MemoryExplorer(SMALL, cache=cache, dp=8, tp=4, zero=3,
                                      offload_optimizer="nvme", offload_param="cpu")
    tiers = explorer.figure.axes[1]
    ticks = [(x, label.get_text()) for x, label in zip(tiers.get_xticks(),
                                                      tiers.get_xticklabels(), strict=True)]
    # 32 ranks, two bars each: every 2nd rank labelled, between its host and NVMe bars
    assert ticks == [(2 * r + 0.5, f"r{r}") for r in range(0, 32, 2)]


def test_the_bytes_written_in_the_traffic_matrix_stay_inside_their_cells():
    # notebook 00 and `minipar demo` show plot_traffic of an 8-rank run, the bytes in the
    # cells; '393.8 KiB' ran past its cell's sides, into the next cell's colour
    from minipar.demo import DEMO_CONFIG
    from minipar.viz.runs import train_report
    from minipar.viz.traffic import plot_traffic

    # the demo's model (dp2 tp2 pp2): cells of 394 KiB to 3.4 MiB
    fig = plot_traffic(train_report(DEMO_CONFIG.replace(steps=1, check=False)))
    fig.set_dpi(INLINE_DPI)
    fig.canvas.draw() if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    written = 0
    for ax in fig.axes[:-1]:  # the matrices; the last axes is the colour bar
        for text in ax.texts:
            j, i = text.get_position()
            (x0, y0), (x1, y1) = ax.transData.transform([(j - 0.5, i - 0.5),
                                                          (j + 0.5, i + 0.5)])
            # with room to spare: a number touching both sides reads as running over
            extent = text.get_window_extent(renderer).padded(LABEL_GAP_PX / 2)
            assert min(x0, x1) <= extent.x0 and extent.x1 <= max(x0, x1), text.get_text()
            assert min(y0, y1) <= extent.y0 and extent.y1 <= max(y0, y1), text.get_text()
            written += 1
    assert written >= 8 * 3  # every rank's cell in each of the three panels
