"""The explorers' lattices shipped with the package: every setting of each default
explorer's lattice is in its file, what the file says is what minipar measures today (a
sample measured again), and the notebooks' explorers answer their lattice settings with
no run at all."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("anywidget")

from minipar.viz import lattice  # noqa: E402
from minipar.viz.lattice import key_text, lattice_path, shipped  # noqa: E402
from minipar.viz.widgets import (  # noqa: E402
    MemoryExplorer,
    PipelineExplorer,
    ShardingExplorer,
    TrafficExplorer,
)

# What the package may grow by for them (pyproject's package-data): ~0.9 MiB today.
MOST_BYTES = 2 * 2**20


@pytest.fixture(scope="module")
def explorers():
    return {"memory": MemoryExplorer(), "traffic": TrafficExplorer(),
            "pipeline": PipelineExplorer(), "sharding": ShardingExplorer()}


def test_every_setting_of_each_default_explorers_lattice_ships(explorers):
    for name, explorer in explorers.items():
        settings = explorer.lattice()
        assert len(settings) > 50, name
        assert explorer.measurements.shipped, f"{name}: no lattice for the default model"
        missing = [key_text(v) for v in settings
                   if key_text(v) not in explorer.measurements.shipped]
        assert missing == [], f"{name}: {len(missing)} settings not shipped, e.g. {missing[:3]}"


def test_the_lattice_files_are_small():
    total = sum(lattice_path(name).stat().st_size for name in ("train", "pipeline", "sharding"))
    assert total < MOST_BYTES


def _sample(results: dict, small) -> list[str]:
    """A few settings spread over a file (sorted by name), among the cheap ones."""
    keys = [k for k in sorted(results) if small(k)]
    return [keys[0], keys[len(keys) // 3], keys[2 * len(keys) // 3], keys[-1]]


def _values(text: str, explorer) -> dict:
    """The values of a setting's name, typed as the explorer's results are keyed."""
    typed = {}
    for word in text.split(","):
        name, value = word.split("=")
        typed[name] = (value == "True" if value in ("True", "False")
                       else None if value == "None"
                       else int(value) if value.lstrip("-").isdigit() else value)
    return typed


@pytest.mark.parametrize("name", ["train", "pipeline", "sharding"])
def test_a_sample_of_each_lattice_measured_again_is_what_ships(name, explorers):
    measurements = {"train": explorers["memory"], "pipeline": explorers["pipeline"],
                    "sharding": explorers["sharding"]}[name].measurements
    results = shipped(name)[1]

    def small(text):  # at most 4 ranks, or pipelines of at most 8 micro-batch x stages
        v = _values(text, None)
        return (v.get("dp", 1) * v.get("tp", 1) * v.get("pp", 1) <= 4
                and v.get("micro_batches", 1) * v.get("pp", 1) <= 8)

    for text in _sample(results, small):
        again = measurements.measure(_values(text, None))
        assert again == json.loads(results[text]), f"{name} {text}: stale result " \
            "(python -m minipar.viz.build_lattice --fresh)"


def test_the_notebooks_explorers_answer_their_lattice_without_a_run(monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("measured: this setting should have shipped")

    for function in ("train_report", "pipeline_step", "holdings"):
        monkeypatch.setattr(lattice, function, no_run)
    notebook = [  # notebooks 00, 03, 05, 06, and a change each
        (TrafficExplorer(dp=2, tp=2, pp=2, zero=1), dict(zero=2, pp=1)),
        (ShardingExplorer(dp=4, tp=1, pp=1, zero=2, kind="grads"), dict(zero=3)),
        (MemoryExplorer(dp=4, zero=3, precision="bf16-mixed"), dict(offload_optimizer="cpu")),
        (PipelineExplorer(schedule="1f1b", pp=4, micro_batches=8), dict(micro_batches=12)),
        (PipelineExplorer(schedule="zb-v", pp=4, micro_batches=8, virtual_stages=2),
         dict(micro_batches=12)),
        (MemoryExplorer(dp=2, tp=2, pp=2, zero=1, precision="bf16-mixed",
                        grad_accum_steps=4), dict(dp=4)),
        (TrafficExplorer(dp=2, tp=2, pp=2, zero=1, gpus_per_node=4,
                         precision="bf16-mixed", grad_accum_steps=4), dict(tp=4)),
    ]
    for explorer, change in notebook:
        assert explorer.error is None
        explorer.set(**change)
        assert explorer.error is None and explorer.draws == 2
