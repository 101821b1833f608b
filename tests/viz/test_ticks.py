"""TickCopyingAxes draws what plain Axes draw, and its copied ticks share no state."""

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from minipar.viz.ticks import TICK_COPYING, TickCopyingAxes, label_every


def pixels(fig: Figure) -> np.ndarray:
    """The figure drawn by a plain Agg canvas, as RGBA."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()


def many_ticks(axes_class) -> Figure:
    """Ticks styled before and after they exist, labelled, rotated, on both sides, with
    grid lines and minor ticks; a colour bar's log axis."""
    fig = Figure(figsize=(6, 3), dpi=80)
    left, right = fig.subplots(1, 2, subplot_kw={"axes_class": axes_class})
    left.tick_params(labelsize=7, direction="inout", length=5)
    left.set_xticks(range(12), [f"r{i}" for i in range(12)], fontsize=6, rotation=45)
    left.set_yticks(range(9))
    left.tick_params(axis="y", labelright=True, right=True, labelcolor="tab:red")
    left.grid(True)
    left.minorticks_on()
    image = right.imshow(np.arange(1, 65).reshape(8, 8) ** 2, norm=LogNorm())
    right.set_xticks(range(8))
    right.tick_params(labelleft=False, pad=6)
    right.set_title("log colour bar", y=1.0)
    bar_axes = fig.add_axes((0.92, 0.1, 0.02, 0.8), axes_class=axes_class)
    fig.colorbar(image, cax=bar_axes).set_label("bytes")
    return fig


def test_tick_copying_axes_draw_the_same_pixels_as_plain_axes():
    plain, copying = pixels(many_ticks(Axes)), pixels(many_ticks(TickCopyingAxes))
    assert plain.shape == copying.shape
    assert (plain != copying).any(axis=-1).sum() == 0


def test_copied_ticks_are_the_ticks_matplotlib_makes():
    figures = [Figure() for _ in range(2)]
    plain = figures[0].add_axes((0.1, 0.1, 0.8, 0.8))
    copying = figures[1].add_axes((0.1, 0.1, 0.8, 0.8), axes_class=TickCopyingAxes)
    for ax in (plain, copying):
        ax.tick_params(labelsize=7, color="tab:blue", width=2)
        ax.set_yticks(range(6), list("abcdef"), fontsize=9)
        FigureCanvasAgg(ax.figure).draw()
    for mine, theirs in zip(copying.yaxis.get_major_ticks(), plain.yaxis.get_major_ticks(),
                            strict=True):
        assert mine.label1.get_text() == theirs.label1.get_text()
        assert mine.label1.get_fontsize() == theirs.label1.get_fontsize() == 9
        assert mine.tick1line.get_markeredgewidth() == theirs.tick1line.get_markeredgewidth()
        assert mine.tick1line.get_ydata()[0] == theirs.tick1line.get_ydata()[0]
        assert (mine.label1.get_window_extent().bounds
                == pytest.approx(theirs.label1.get_window_extent().bounds))


def test_a_copied_tick_changes_alone():
    ax = Figure().subplots(subplot_kw=TICK_COPYING)
    first, second, third = ax.xaxis.get_major_ticks(3)
    second.label1.set_fontsize(20)
    second.tick1line.set_markeredgecolor("red")
    second.tick1line.set_xdata([5.0])
    second.label1.sticky_edges.x.append(1.0)
    heard = []
    second.label1.add_callback(heard.append)
    first.label1.set_text("first")  # a change to another tick reaches no callback
    assert heard == []
    for other in (first, third):
        assert other.label1.get_fontsize() != 20
        assert other.tick1line.get_markeredgecolor() != "red"
        assert other.tick1line.get_xdata()[0] != 5.0
        assert other.label1.sticky_edges.x == []
    assert isinstance(ax, TickCopyingAxes)


def test_label_every_labels_all_ranks_that_fit_and_powers_of_two_past_them():
    assert [label_every(n, 8) for n in (1, 8, 9, 16, 17, 64, 128)] == [1, 1, 2, 2, 4, 8, 16]
    assert label_every(32, 12) == 4  # 32 / 4 = 8 labels: within room for 12
    assert label_every(16, 0) == 16  # an axis with room for none: one label, no hang
