"""The time model against a real cluster: Narayanan et al. 2021, Table 1.

The expected values are the paper's (copied here from the table, not from the planner):
every row's predicted TFLOP/s per GPU within 10%, and throughput rising with model size
from 18.4B up, as it does on Selene. The uniform model (one efficiency for every FLOP)
misses both, which is why the roofline exists.
"""

from __future__ import annotations

import math

import pytest

from minipar.cli import main
from minipar.plan import presets
from minipar.plan.published import TABLE_1, compare, paper_flops

# (params, heads, h, layers, t, p, GPUs, global batch, achieved TFLOP/s per GPU)
PUBLISHED = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
TARGET = 0.10


@pytest.fixture(scope="module")
def predicted() -> dict[str, float]:
    return {row["model"]: row["tflops"] for row in compare()}


def test_the_rows_are_the_papers():
    assert [(r.name, r.heads, r.hidden, r.layers, r.tp, r.pp, r.gpus, r.global_batch,
             r.tflops) for r in TABLE_1] == PUBLISHED
    for run, (name, *_) in zip(TABLE_1, PUBLISHED, strict=True):
        # the parameter count in the row's name (the paper's 12 l h^2 (1 + 13/12h +
        # (V + s)/12lh); the labels round it: 1.65B is "1.7B", 3.56B "3.6B")
        billions = float(name.rstrip("B"))
        assert run.shape.n_params / 1e9 == pytest.approx(billions, rel=0.03)
        assert run.config.world_size == run.gpus


def test_eq3_is_the_model_flops_with_the_layers_counted_four_times():
    # 96 B s l h^2 (1 + s/6h + V/16lh): the layers' forward 4 times (recomputation), the
    # logits' 3 times; the planner's model FLOPs count each 3 times
    run = TABLE_1[-1]
    shape, batch = run.shape, run.global_batch
    logits = 3 * 2 * shape.seq_len * shape.d_model * shape.vocab_size * batch
    layers = shape.model_flops_per_sequence() * batch - logits
    assert paper_flops(shape, batch) == pytest.approx(4 / 3 * layers + logits, rel=1e-12)
    # the paper's headline: the 1T model at 502 petaFLOP/s on 3072 GPUs = 163 per GPU
    assert 163 * 3072 / 1000 == pytest.approx(502, rel=0.005)


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_every_row_within_ten_percent_of_the_published_throughput(row, predicted):
    name, published = row[0], row[-1]
    assert predicted[name] == pytest.approx(published, rel=TARGET), (
        f"{name}: predicted {predicted[name]:.1f}, published {published}")


def test_throughput_rises_with_model_size_from_18b_up(predicted):
    rows = PUBLISHED[3:]
    sizes = [float(r[0].rstrip("B")) for r in rows]
    ours = [predicted[r[0]] for r in rows]
    # Spearman rank correlation of size and predicted throughput (the published one is
    # 0.98 with its tie): strongly positive
    order = sorted(range(len(ours)), key=ours.__getitem__)
    ranks = [order.index(i) for i in range(len(ours))]
    n = len(ranks)
    rho = 1 - 6 * sum((i - r) ** 2 for i, r in enumerate(ranks)) / (n * (n * n - 1))
    assert rho >= 0.8
    # and the least-squares slope of TFLOP/s against log(size) is within a factor of two
    # of the published slope (which is positive: 135 at 18.4B, 163 at 1T)
    def slope(values):
        xs = [math.log(s) for s in sizes]
        mx, my = sum(xs) / n, sum(values) / n
        return (sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True))
                / sum((x - mx) ** 2 for x in xs))

    published_slope = slope([r[-1] for r in rows])
    assert published_slope > 0
    assert 0.5 * published_slope < slope(ours) < 2 * published_slope


def test_the_uniform_model_misses_the_target():
    # One efficiency (60% of peak) for every FLOP: the small models come out far too fast
    uniform = compare(presets.cluster("a100").uniform(0.6))
    errors = {row["model"]: row["error"] for row in uniform}
    assert errors["1.7B"] > TARGET
    assert errors["1.7B"] > errors["1008.0B"]  # the wrong trend


def test_cli_prints_published_vs_predicted_and_the_assumptions(capsys):
    assert main(["plan", "--compare-published"]) == 0
    out = capsys.readouterr().out
    for name, *_, published in PUBLISHED:
        assert any(line.split()[:1] == [name] and f" {published} " in line
                   for line in out.splitlines()), name
    assert "assumptions:" in out and "run_table_1.sh" in out
    assert "error" in out.splitlines()[2]


def test_cli_compare_published_refuses_a_layout(capsys):
    assert main(["plan", "--compare-published", "--model", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compare-published" in err
