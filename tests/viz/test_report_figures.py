"""Per-rank memory bars, the traffic matrix and the text tables, drawn from reports:
each bar, cell and row shows the measured number it stands for."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from minipar.train import TrainConfig, train
from minipar.train.report import Report
from minipar.viz.memory import COLORS, plot_memory
from minipar.viz.tables import human_seconds, time_table, traffic_table
from minipar.viz.traffic import cell_bytes, plot_sent_bytes, plot_traffic, traffic_matrices

MIB = 2**20


def rank(r, coords, memory, sent_by_group, time, at_peak):
    sent = sum(sent_by_group.values())
    return {"rank": r, "coords": coords, "node": 0,
            "memory": {**memory, "peak_total": sum(at_peak.values())},
            "memory_at_peak": at_peak,
            "comm": {"sent_bytes": sent, "recv_bytes": sent, "calls": 6,
                     "by_op": {"all_reduce": sent}, "by_group": sent_by_group},
            "time": time}


def two_rank_report() -> Report:
    # each category's own peak, and what the rank held at the instant of its peak_total
    memory = [dict(params=1 * MIB, grads=1 * MIB, optimizer=2 * MIB, activations=3 * MIB,
                   buffers=0),
              dict(params=1 * MIB, grads=0, optimizer=1 * MIB, activations=1 * MIB,
                   buffers=MIB)]
    at_peak = [dict(params=1 * MIB, grads=0, optimizer=2 * MIB, activations=3 * MIB,
                    buffers=0),
               dict(params=1 * MIB, grads=0, optimizer=1 * MIB, activations=MIB // 2,
                    buffers=MIB)]
    ranks = [rank(0, {"dp": 0, "pp": 0, "tp": 0}, memory[0], {"tp": 300, "pp": 0},
                  {"compute_s": 3.0, "comm_s": 1.0, "idle_s": 0.0}, at_peak[0]),
             rank(1, {"dp": 0, "pp": 0, "tp": 1}, memory[1], {"tp": 300, "pp": 60},
                  {"compute_s": 1.0, "comm_s": 1.0, "idle_s": 2.0}, at_peak[1])]
    steps = [{"step": s, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0} for s in range(3)]
    traffic = {"matrix": [[0, 300], [360, 0]],
               "by_group": {"tp": [[0, 300], [300, 0]], "pp": [[0, 0], [60, 0]]}}
    return Report(config={}, world_size=2, n_params=10, steps=steps, ranks=ranks,
                  traffic=traffic, layout={"gpus_per_node": 1})


def stacked(fig: Figure):
    """{(x, colour): (bottom, height)} of the bars drawn."""
    (ax,) = fig.axes
    return {(round(p.get_x() + p.get_width() / 2), to_hex(p.get_facecolor())):
            (p.get_y(), p.get_height()) for p in ax.patches if p.get_height() > 0}


def test_memory_bars_stack_what_each_rank_held_at_its_peak_with_a_baseline_first():
    report = two_rank_report()
    baseline = Report(config={}, world_size=1, n_params=10, ranks=[report.ranks[0]])
    fig = plot_memory(report, baselines={"1 GPU": baseline})
    (ax,) = fig.axes
    assert "MiB" in ax.get_ylabel()
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == [
        "1 GPU", "rank 0", "rank 1"]
    bars = stacked(fig)
    # rank 1 (x = 2) at its peak: params 0-1, optimizer 1-2 (no grads), activations
    # 2-2.5, buffers 2.5-3.5: the stack ends at peak_total, not at the sum of own peaks
    assert bars[(2, COLORS["params"])] == pytest.approx((0, 1))
    assert (2, COLORS["grads"]) not in bars
    assert bars[(2, COLORS["optimizer"])] == pytest.approx((1, 1))
    assert bars[(2, COLORS["activations"])] == pytest.approx((2, 0.5))
    assert bars[(2, COLORS["buffers"])] == pytest.approx((2.5, 1))
    assert bars[(0, COLORS["activations"])] == pytest.approx((3, 3))  # the baseline
    assert (0, COLORS["grads"]) not in bars  # its gradients peaked at another instant
    lines = [(round(np.mean(line.get_xdata())), to_hex(line.get_color()), line.get_ydata()[0])
             for line in ax.lines]
    ticks = [y for _, color, y in lines if color == "#000000"]  # peak_total, one per bar
    assert ticks == pytest.approx([6, 6, 3.5])
    # each category's own peak, a dash beside the bar, from zero: rank 0's gradients
    # (1 MiB) that the stack leaves out, rank 1's activations (1 MiB, 0.5 in the stack)
    own = {(x, color): y for x, color, y in lines if color != "#000000"}
    assert own[(1, COLORS["grads"])] == pytest.approx(1)
    assert own[(2, COLORS["activations"])] == pytest.approx(1)
    assert (2, COLORS["grads"]) not in own  # never held: no dash


def test_traffic_matrix_has_a_panel_per_group_with_bytes_per_step():
    report = two_rank_report()
    matrices = traffic_matrices(report)
    assert list(matrices) == ["tp", "pp"]
    np.testing.assert_allclose(matrices["pp"], [[0, 0], [20, 0]])  # 60 bytes over 3 steps
    fig = plot_traffic(report)
    tp, pp = (ax for ax in fig.axes if ax.get_label() != "<colorbar>")
    assert "tensor parallel" in tp.get_title() and "200 B per step" in tp.get_title()
    assert "pipeline" in pp.get_title()
    shown = np.ma.filled(pp.images[0].get_array(), 0)
    np.testing.assert_allclose(shown, [[0, 0], [20, 0]])
    assert [t.get_text() for t in pp.texts] == ["20\nB"]


def test_expert_parallel_all_to_all_has_its_own_panel():
    report = train(TrainConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, micro_batch_size=2,
                               steps=1, data="synthetic", dp=2, ep=2, moe_num_experts=2,
                               moe_top_k=1))
    matrices = traffic_matrices(report)
    assert list(matrices) == ["dp", "ep"]  # the dense gradients, the all-to-alls
    fig = plot_traffic(report)
    _, ep = (ax for ax in fig.axes if ax.get_label() != "<colorbar>")
    assert "expert parallel" in ep.get_title()


@pytest.mark.parametrize("n, written", [
    (0, "0\nB"), (999, "999\nB"), (1000, "1.0\nKiB"), (9.94 * 2**10, "9.9\nKiB"),
    (9.96 * 2**10, "10\nKiB"), (403_251, "394\nKiB"), (999.4 * 2**10, "999\nKiB"),
    (999.6 * 2**10, "1.0\nMiB"), (888 * 2**20, "888\nMiB"), (3 * 2**40, "3.0\nTiB")])
def test_a_cells_bytes_are_three_digits_at_most_over_their_unit(n, written):
    # the matrix cells of an 8-rank picture are 0.23 in wide: '393.8' filled one
    assert cell_bytes(n) == written
    assert sum(c.isdigit() for c in written.split("\n")[0]) <= 3


def test_traffic_needs_a_report_that_sent_something():
    with pytest.raises(ValueError, match="no traffic"):
        plot_traffic(Report(config={}, world_size=1, n_params=1))


def test_traffic_table_shows_bytes_per_step_by_group_and_op():
    table = traffic_table(two_rank_report())
    header, rule, row0, row1 = table.splitlines()
    assert header.split()[:7] == ["rank", "dp/pp/tp", "node", "tp", "group", "pp", "group"]
    assert "all_reduce" in header and "sent/step" in header
    assert row1.split()[3:5] == ["100", "B"]  # tp: 300 bytes / 3 steps
    assert row1.split()[5:7] == ["20", "B"]  # pp: 60 / 3
    assert row1.split()[-1] == "2"  # 6 calls / 3 steps


def test_traffic_table_has_a_column_for_every_group_kind_that_sent_bytes():
    """MoE's expert-parallel group ("ep": the all-to-alls) is a column too, not dropped."""
    report = two_rank_report()
    for r in report.ranks:
        r["comm"]["by_group"]["ep"] = 90
    header = traffic_table(report).splitlines()[0].split()
    assert header[3:9] == ["tp", "group", "pp", "group", "ep", "group"]


def test_time_table_shows_each_ranks_compute_comm_idle_and_shares():
    table = time_table(two_rank_report())
    row1 = table.splitlines()[3].split()
    assert row1[2:8] == ["1.0", "s", "1.0", "s", "2.0", "s"]
    assert row1[8:] == ["25%", "25%", "50%"]
    assert human_seconds(1.5e-4) == "150.0 us" and human_seconds(2e-9) == "2.0 ns"


def test_figures_of_a_real_3d_run_save_as_png(tmp_path):
    report = train(TrainConfig(dp=2, tp=2, pp=2, zero=1, n_layer=2, seq_len=8, d_model=16,
                               n_head=2, micro_batch_size=1, grad_accum_steps=2, steps=1))
    for name, fig in (("memory", plot_memory(report)), ("traffic", plot_traffic(report))):
        path = tmp_path / f"{name}.png"
        fig.savefig(path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(traffic_matrices(report)) == ["tp", "pp", "dp"]


def ring_report(world: int, per_node: int, sent: float = 1000.0, spread: float = 1.01):
    """A report whose ranks send along a TP ring, `spread` apart from the least to the most
    (no ranks' own numbers needed: the traffic matrix is what plot_traffic draws)."""
    matrix = np.zeros((world, world))
    for r in range(world):
        matrix[r, (r + 1) % world] = sent * (1 + (spread - 1) * r / max(world - 1, 1))
    return Report(config={}, world_size=world, n_params=1, steps=[{"step": 0}],
                  traffic={"matrix": matrix.tolist(), "by_group": {"tp": matrix.tolist()}},
                  layout={"gpus_per_node": per_node})


def test_near_equal_bytes_get_near_equal_colours_and_distinct_colour_bar_ticks():
    fig = plot_traffic(ring_report(4, 4, spread=1.01))  # within 1%
    panel, bar = fig.axes
    norm = panel.images[0].norm
    assert norm.vmax / norm.vmin >= 4  # the darkest colour is a factor 4 below the most
    labels = [t.get_text() for t in bar.get_yticklabels()]
    assert len(set(labels)) == len(labels)  # not four times "1000 B"


def test_node_boundaries_are_drawn_up_to_8_nodes_and_said_past_them():
    drawn = plot_traffic(ring_report(32, 4))  # 8 nodes: 7 boundaries a side
    assert len(drawn.axes[0].lines) == 2 * 7
    said = plot_traffic(ring_report(36, 4))  # 9 nodes: a mesh of dashes; said instead
    assert len(said.axes[0].lines) == 0 and "9 nodes of 4 ranks" in said._suptitle.get_text()


def test_a_single_panel_is_centred_at_most_max_side_in_a_wide_figure():
    from minipar.viz.traffic import MAX_SIDE

    fig = plot_traffic(ring_report(4, 4), width=8.0)
    panel = fig.axes[0]
    side = panel.get_position().width * fig.get_size_inches()[0]
    assert fig.get_size_inches()[0] == 8.0 and side == pytest.approx(MAX_SIDE)
    with pytest.raises(ValueError, match="leaves 0.11 in per panel for 2 panels"):
        plot_traffic(two_rank_report(), width=2.4)


def test_sent_bytes_start_at_zero_and_say_which_ops_are_too_thin_to_see():
    # dp 8 by op: the loss's 16-byte all-reduce under 700 KiB reduce-scatters stopped the
    # autoscaled axis at 7.6e-06 MiB and its 0 tick vanished; its legend entry showed no bar
    report = two_rank_report()
    report.steps = report.steps[:1]
    for r, loss_bytes in zip(report.ranks, (16, 8), strict=True):  # as measured at dp 8
        by_op = {"all_reduce": loss_bytes, "reduce_scatter": 719040, "all_gather": 719040}
        r["comm"]["by_op"], r["comm"]["sent_bytes"] = by_op, sum(by_op.values())
    fig = plot_sent_bytes(report, by="op")
    (ax,) = fig.axes
    assert ax.get_ylim()[0] == 0
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["all_reduce (<1%)", "reduce_scatter", "all_gather"]


def test_runs_side_by_side_stack_rank_0_of_each_at_its_peak():
    from minipar.viz.memory import memory_comparison_picture

    report = two_rank_report()
    other = Report(config={}, world_size=1, n_params=10, ranks=[report.ranks[1]])
    picture = memory_comparison_picture({"A": report, "B": other})
    (panel,) = picture["panels"]
    assert [label for _, label in panel["ticks"]] == ["A", "B"]
    assert panel["markers"] == [6 * MIB, 3.5 * MIB]  # each run's peak_total
    stacked_sum = [sum(series["values"][i] for series in panel["series"]) for i in (0, 1)]
    assert stacked_sum == panel["markers"]
    own = {series["name"]: series["values"] for series in panel["own_peaks"]}
    assert own["grads"] == [MIB, 0] and own["activations"] == [3 * MIB, MIB]
    assert not any(panel["hatched"])
