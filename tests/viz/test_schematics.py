"""The schematic figures are drawn from what the trainer runs: each picture's data agrees
with the algorithm or the measurement it stands for, and each draws."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.distributed.ring import all_reduce_chunks
from minipar.viz.predict import judge, judge_choice
from minipar.viz.schematics.layer import draw_layer_splits, layer_splits_picture
from minipar.viz.schematics.pipeline import (
    draw_schedule_dependencies,
    schedule_dependencies_picture,
)
from minipar.viz.schematics.ring import draw_ring, ring_picture
from minipar.viz.schematics.tensor import draw_tensor_split, tensor_split_picture
from minipar.viz.schematics.zero import draw_zero_partitions, zero_partitions_picture


@pytest.mark.parametrize("n", [2, 4, 5])
def test_the_ring_picture_ends_with_every_chunk_summed_on_every_rank(n):
    picture = ring_picture(n)
    steps = picture["steps"]
    assert len(steps) == 2 * (n - 1)
    # after the reduce-scatter, rank i holds chunk (i + 1) complete: the textbook's state
    after = steps[n - 2]["holds"]
    assert all(after[i][(i + 1) % n] == list(range(n)) for i in range(n))
    assert all(chunk == list(range(n)) for rank in steps[-1]["holds"] for chunk in rank)
    # every send goes to the successor, S/n bytes at a time: 2(n-1)/n of the tensor
    assert all(send["to"] == (i + 1) % n for step in steps
               for i, send in enumerate(step["sends"]))
    assert picture["sent_per_rank"] == 2 * (n - 1) * picture["chunk_bytes"]
    draw_ring(picture)


def test_the_rings_chunk_order_is_what_ring_all_reduce_sums():
    """Ranks start with one-hot values: the result says every chunk summed every rank
    once, with the chunk order the picture draws."""
    n = 4

    def rank():
        x = np.zeros(n * 8)
        x[:] = 2.0 ** dist.get_rank()
        return dist.ring_all_reduce(x)

    for result in dist.launch(rank, n):
        assert (result == 2**n - 1).all()
    sent = [all_reduce_chunks(i, n, 0)[0] for i in range(n)]
    assert sent == list(range(n))  # step 1: each rank passes on its own chunk i


def test_the_tensor_picture_reads_columns_and_rows_and_four_all_reduces_per_layer():
    picture = tensor_split_picture(2)
    a, b = np.asarray(picture["A"]), np.asarray(picture["B"])
    d = picture["d"]
    assert a.shape == (d, 4 * d) and b.shape == (4 * d, d)
    assert (a[:, : 2 * d] == 0).all() and (a[:, 2 * d:] == 1).all()  # by columns
    assert (b[: 2 * d] == 0).all() and (b[2 * d:] == 1).all()  # by rows
    ops = {(op, phase): calls for op, phase, calls, _ in picture["collectives"]}
    assert ops == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}
    draw_tensor_split(picture)


def test_the_zero_picture_holds_the_papers_bytes_per_parameter():
    picture = zero_partitions_picture(4)
    n = picture["dp"]
    expected = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}
    for stage in picture["stages"]:
        for row in stage["ranks"]:
            held = sum(row["nbytes"].values()) / stage["n_params"]
            assert held == pytest.approx(expected[stage["zero"]], abs=1e-2)
        # every slice of the model is held by exactly one rank under ZeRO-3
        if stage["zero"] == 3:
            total = np.sum([row["shares"]["params"] for row in stage["ranks"]], axis=0)
            assert np.allclose(total, 1.0)
    draw_zero_partitions(picture)


def test_the_1f1b_picture_draws_every_message_of_the_schedule_forward_in_time():
    picture = schedule_dependencies_picture("1f1b", 4, 8)
    arrows = picture["arrows"]
    assert len(arrows) == 2 * 8 * 3  # activations and gradients, m x (p-1) each
    assert all(used >= sent for _, sent, _, used, _ in arrows)
    assert picture["in_flight"] == [4, 3, 2, 1]
    gpipe = schedule_dependencies_picture("gpipe", 4, 8)
    assert gpipe["in_flight"] == [8] * 4
    draw_schedule_dependencies(picture)
    with pytest.raises(ValueError, match="model chunks"):
        schedule_dependencies_picture("interleaved", 2, 4)


def test_the_layer_picture_measures_what_each_split_cuts_and_calls():
    rows = {row["name"]: row for row in layer_splits_picture()["rows"]}
    assert rows["DP"]["params"] == 1 and rows["DP"]["activations"] == pytest.approx(0.5)
    assert rows["TP"]["params"] < 0.6 < rows["TP"]["activations"] < 0.7  # not 1/t
    assert rows["SP (with TP)"]["activations"] < rows["TP"]["activations"]
    assert {op for op, *_ in rows["SP (with TP)"]["calls"]} >= {"all_gather",
                                                                "reduce_scatter"}
    assert [op for op, *_ in rows["TP"]["calls"]] == ["all_reduce"]
    assert [op for op, *_ in rows["EP"]["calls"]] == ["all_to_all"]
    assert [op for op, *_ in rows["CP"]["calls"]] == ["send"]
    assert rows["CP"]["params"] == 1
    draw_layer_splits({"rows": list(rows.values()), "model": {"n_layer": 2, "d_model": 32,
                                                              "seq_len": 16}})


def test_a_prediction_is_judged_against_the_measurement():
    assert "close (+4%)" in judge(1.04, 1.0, "x")
    assert "off, the measurement is 4x your figure" in judge(0.25, 1.0, "x")
    assert "off, your figure is 4x the measurement" in judge(4, 1.0, "x")
    assert "write a prediction" in judge(None, 1.0, "x")
    assert "exactly" in judge(2, 2.0, "x")
    with pytest.raises(ValueError, match="write a number"):
        judge(float("nan"), 1.0, "x")
    options = {"a": "one", "b": "two"}
    assert "right" in judge_choice("b", "b", options)
    assert "measured: (b) two" in judge_choice("a", "b", options)
    with pytest.raises(ValueError, match="one of the options"):
        judge_choice("c", "b", options)
