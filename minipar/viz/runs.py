"""The measured runs behind the explorers and the notebooks, and a cache for them.

    cache = RunCache()
    report = cache.get(("train", key), lambda: train_report(config))   # once per key
    step = pipeline_step("1f1b", pp=4, micro_batches=8)                 # one pipeline step

`train_report` is `minipar.train.train`; `pipeline_step` runs one training step of a
`minipar.parallel.pipeline.model.Pipeline` on p virtual ranks of a deliberately slow device
with free links (PIPELINE_DEVICE), so the timelines look like a big model's: compute
dominates and the bubble is the grey between the bars.

What an explorer keeps of a run is its summary, JSON: `train_summary(report)` the report
fields the memory and traffic pictures read (each rank's memory tiers, transfers and
bytes sent, the traffic matrices), `summary_report` a Report of them again (the pictures
drawn from it are the full report's: tests/viz/test_lattice.py); `pipeline_summary` the
timelines, bubble and activations of a pipeline step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from minipar import distributed as dist
from minipar.distributed.timeline import bubble_fraction
from minipar.nn import GPTConfig
from minipar.parallel.pipeline.model import Pipeline
from minipar.parallel.pipeline.schedules.registry import uniform_bubble_fraction
from minipar.parallel.pipeline.simulator import in_flight_peak
from minipar.train.config import TrainConfig
from minipar.train.data import make_stream
from minipar.train.mixes import check_layout
from minipar.train.report import MEMORY_CATEGORIES, Report


class RunCache:
    """Measured runs by their settings: `get(key, compute)` runs `compute()` once per key.

    hits / misses count lookups, so a benchmark (or a curious user) can see the cache
    working. One cache can serve several explorers."""

    def __init__(self) -> None:
        self._runs: dict = {}
        self.hits = 0
        self.misses = 0

    def get(self, key, compute: Callable):
        if key in self._runs:
            self.hits += 1
            return self._runs[key]
        self.misses += 1
        value = compute()
        self._runs[key] = value
        return value

    def __contains__(self, key) -> bool:
        return key in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def clear(self) -> None:
        self._runs.clear()


def train_report(config: TrainConfig, device: dist.DeviceProfile | None = None) -> Report:
    """minipar.train.train(config) (imported late: the module also exports a function
    called `train`)."""
    from minipar.train import train

    return train(config, device=device)



# A device slow enough that this toy model computes for longer than a message takes, as
# a real model does: one block forward of one micro-batch is a few microseconds.
PIPELINE_DEVICE = dist.DeviceProfile(name="toy GPU (1 TFLOP/s, free links)", flops=1e12,
                                     intra_node_bandwidth=math.inf,
                                     inter_node_bandwidth=math.inf,
                                     intra_node_latency=0.0, inter_node_latency=0.0)
PIPELINE_MODEL = dict(vocab_size=16, seq_len=16, n_head=2, d_model=32)


def pipeline_step(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1, *,
                  layer_split=None, layers_per_stage: int = 1, micro_batch_size: int = 2,
                  vocab_size: int | None = None, device: dist.DeviceProfile = PIPELINE_DEVICE,
                  seed: int = 0) -> dict:
    """One measured training step of a pipeline over `pp` virtual ranks.

    The model has pp x virtual_stages x layers_per_stage blocks (or sum(layer_split))
    and a tiny vocabulary (vocab_size to change it), so the stages are nearly uniform.
    Returns the timelines, the measured bubble (idle / total rank-time), the paper's
    formula for uniform stages, per rank the peak micro-batches in flight (from the
    schedule) and the peak
    "activations" bytes (from the ledger), and the loss.
    """
    n_layer = (sum(layer_split) if layer_split is not None
               else pp * virtual_stages * layers_per_stage)
    # vocab_size: a larger vocabulary makes the last stage's head cost more (notebook 05)
    config = GPTConfig(n_layer=n_layer, **{**PIPELINE_MODEL, **(
        {} if vocab_size is None else {"vocab_size": vocab_size})})
    rng = np.random.default_rng(seed)
    shape = (micro_batch_size, config.seq_len)
    batches = [(rng.integers(0, config.vocab_size, shape),
                rng.integers(0, config.vocab_size, shape)) for _ in range(micro_batches)]

    def rank():
        pipe = Pipeline(config, schedule=schedule, micro_batches=micro_batches,
                        virtual_stages=virtual_stages, layer_split=layer_split,
                        precision="fp32", seed=seed)
        loss = pipe.forward_backward(batches)
        return loss, pipe.schedule

    results, devices = dist.launch(rank, pp, device=device, return_devices=True)
    schedule_ = results[0][1]
    timelines = [d.clock.events for d in devices]
    v = virtual_stages
    return {
        "timelines": timelines,
        "bubble": bubble_fraction(timelines),
        "formula": uniform_bubble_fraction(schedule, pp, micro_batches, v),
        "in_flight": [in_flight_peak(schedule_, r) for r in range(pp)],
        "activations": [d.memory.peak["activations"] for d in devices],
        "step_s": max(e.end for t in timelines for e in t),
        "loss": results[0][0],
        "schedule": schedule_,
    }


def pipeline_summary(step: dict) -> dict:
    """What the pipeline explorer reads of a `pipeline_step`, as JSON: per rank its
    timeline as [kind, start, end, label] events, the measured bubble and the formula's,
    the peak forwards in flight and activation bytes per rank."""
    return {"timelines": [[[e.kind, e.start, e.end, e.label] for e in timeline]
                          for timeline in step["timelines"]],
            "bubble": step["bubble"], "formula": step["formula"],
            "in_flight": [int(n) for n in step["in_flight"]],
            "activations": [int(n) for n in step["activations"]]}


# ------------------------------------------------------------------ training runs
# What the memory and traffic pictures read of a rank's report (minipar/viz/memory.py,
# traffic.py), kept compact: each memory tier as its bytes per category then its
# peak_total, a tier or the transfers only when not all zero, the bytes sent by group
# and by collective only where not zero; not "node", which depends on the GPUs per node
# the traffic explorer shows any of.
MEMORY_FIELDS = (*MEMORY_CATEGORIES, "peak_total")
TIERS = ("memory", "memory_host", "memory_nvme")
TRANSFER_FIELDS = ("to_host_bytes", "to_device_bytes", "nvme_read_bytes", "nvme_write_bytes")


def train_summary(report: Report) -> dict:
    """The report fields the memory and traffic explorers draw, compact JSON: per rank its
    memory tiers (each category's own peak, peak_total, and what the tier held at that
    peak), the bytes it moved between them and the bytes it sent; the traffic matrices
    as [i, j, bytes] of their cells that sent any."""
    ranks = []
    for r in report.ranks:
        rank = {"coords": r["coords"]}
        for tier in TIERS:  # its own peaks, peak_total, then what it held at that peak
            if tier in r and (tier == "memory" or any(r[tier].values())):
                rank[tier] = ([r[tier][field] for field in MEMORY_FIELDS]
                              + [r[f"{tier}_at_peak"][c] for c in MEMORY_CATEGORIES])
        moved = [r.get("transfers", {}).get(field, 0) for field in TRANSFER_FIELDS]
        if any(moved):
            rank["transfers"] = moved
        comm = r["comm"]
        rank["comm"] = [comm["sent_bytes"], comm["calls"],
                        {k: v for k, v in comm["by_group"].items() if v},
                        {k: v for k, v in comm["by_op"].items() if v}]
        ranks.append(rank)
    traffic = report.traffic or {}
    return {"world_size": report.world_size, "n_params": report.n_params,
            "steps": len(report.steps), "ranks": ranks,
            "traffic": {"matrix": _cells(traffic.get("matrix")),
                        "by_group": {k: _cells(m) for k, m in
                                     traffic.get("by_group", {}).items()}}}


def summary_report(summary: dict, config: TrainConfig | dict) -> Report:
    """A Report of a `train_summary`'s fields (the rest empty), for the pictures; config:
    the run's, or its `to_dict()` (an explorer keeps its model's and sets the settings)."""
    world = summary["world_size"]
    traffic = summary["traffic"]
    ranks = []
    for index, r in enumerate(summary["ranks"]):
        rank = {"rank": index, "coords": r["coords"]}
        for tier in TIERS:
            values = r.get(tier, [0] * (len(MEMORY_FIELDS) + len(MEMORY_CATEGORIES)))
            rank[tier] = dict(zip(MEMORY_FIELDS, values[:len(MEMORY_FIELDS)], strict=True))
            rank[f"{tier}_at_peak"] = dict(zip(MEMORY_CATEGORIES, values[len(MEMORY_FIELDS):],
                                               strict=True))
        rank["transfers"] = dict(zip(TRANSFER_FIELDS, r.get("transfers", [0] * 4),
                                     strict=True))
        sent, calls, by_group, by_op = r["comm"]
        rank["comm"] = {"sent_bytes": sent, "calls": calls, "by_group": by_group,
                        "by_op": by_op}
        ranks.append(rank)
    config = config if isinstance(config, dict) else config.to_dict()
    return Report(config=config, world_size=world, n_params=summary["n_params"],
                  steps=[{} for _ in range(summary["steps"])], ranks=ranks,
                  traffic={"matrix": _dense(traffic["matrix"], world),
                           "by_group": {k: _dense(cells, world)
                                        for k, cells in traffic["by_group"].items()}})


def _cells(matrix) -> list[list[int]]:
    """[i, j, value] of the non-zero cells of a square matrix (lists or None)."""
    if matrix is None:
        return []
    matrix = np.asarray(matrix, dtype=np.int64)
    return [[int(i), int(j), int(matrix[i, j])] for i, j in zip(*np.nonzero(matrix),
                                                                strict=True)]


def _dense(cells: list, world: int) -> np.ndarray:
    matrix = np.zeros((world, world), np.int64)
    for i, j, value in cells:
        matrix[i, j] = value
    return matrix



@functools.lru_cache(maxsize=8)
def vocab_size(data: str) -> int:
    """The vocabulary of a data source (read once per process)."""
    return make_stream(data).vocab_size


def check_training_layout(config: TrainConfig) -> None:
    """The rules `train` applies before it runs (minipar.train.mixes.check_layout), on
    `config` with its data's vocabulary: a refusal in ~2 ms instead of after the worker."""
    check_layout(config.replace(vocab_size=config.vocab_size or vocab_size(config.data)))
