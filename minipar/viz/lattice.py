"""What the explorers measure, setting by setting, and where each result is found: the
lattice of settings measured once and shipped with the package, the disk, or a run now.

    runs = TrainRuns(EXPLORER_CONFIG, RunCache())     # the memory and traffic explorers'
    runs.known({"dp": 2, "tp": 2, ...})   # the result if measured already, else None
    runs.get({"dp": 2, "tp": 2, ...})     # ... or measured now, and kept
    key_text({"dp": 2, "tp": 1})          # "dp=2,tp=1": a setting's name in a lattice file

Every explorer setting is a deterministic run: the same config gives the same bytes and
simulated times, bit for bit. So the results of the settings each explorer offers (its
lattice: `Explorer.lattice`) are measured once, by `python -m minipar.viz.build_lattice`,
and kept in `minipar/viz/lattice/<name>.json.gz` (package data): the report fields the
pictures read (`train_summary`, `pipeline_summary`, `holdings_summary`), never pictures.
An explorer built on the model a file was measured for reads its results from there; any
other setting is looked up on disk (minipar/viz/store.py: measured before on this
machine) and otherwise measured, then kept on disk. tests/viz/test_lattice.py measures a
sample of every file again and compares, so a change of what minipar measures cannot
leave a stale lattice behind.
"""

from __future__ import annotations

import functools
import gzip
import json
import pathlib

from minipar.train.config import TrainConfig
from minipar.viz.runs import (
    RunCache,
    pipeline_step,
    pipeline_summary,
    train_report,
    train_summary,
)
from minipar.viz.sharding import DEFAULT_CONFIG, holdings, holdings_summary
from minipar.viz.store import result_store

LATTICE_DIR = pathlib.Path(__file__).with_name("lattice")
# The format of each lattice file: "train" 3 since its memory tiers carry what each held
# at its peak (runs.train_summary); a file of another format is not read (measured again
# by build_lattice).
FORMATS = {"train": 3, "pipeline": 2, "sharding": 2}
# What the training explorers measure: the controls of the memory explorer, the traffic
# explorer's among them (its other settings are views of the same run).
TRAIN_SETTINGS = ("dp", "tp", "pp", "zero", "precision", "micro_batch_size",
                  "grad_accum_steps", "recompute_granularity", "offload_optimizer",
                  "offload_param", "gpus_per_node", "hsdp_shard_size",
                  "zero_hpz_partition_size", "zero_quantized_weights",
                  "zero_quantized_gradients", "reshard_after_forward")


def key_text(values: dict) -> str:
    """A setting's name in a lattice file and on disk: "name=value" sorted by name."""
    return ",".join(f"{name}={values[name]}" for name in sorted(values))


def lattice_path(name: str) -> pathlib.Path:
    return LATTICE_DIR / f"{name}.json.gz"


@functools.cache
def shipped(name: str) -> tuple[dict | None, dict[str, str]] | None:
    """The lattice file `name` of the package, read once per process: (the model it was
    measured for, {setting's name: its result as JSON text}), or None. A file is gzipped
    lines: a header ({"format", "config"}), then "name<TAB>result" per setting; a result
    is parsed when asked for (`Measurements.known`): the train file is ~20 MB of JSON,
    ~0.6 s to parse whole, ~30 ms to split into lines."""
    path = lattice_path(name)
    if not path.is_file():
        return None
    with gzip.open(path, "rb") as file:
        header, *lines = file.read().decode("utf-8").splitlines()
    head = json.loads(header)
    if head.get("format") != FORMATS[name]:
        return None
    return head["config"], dict(line.split("\t", 1) for line in lines)


def write_lattice(name: str, config: dict | None, results: dict[str, dict]) -> pathlib.Path:
    """Write a lattice file (`shipped`'s format; the same results give the same bytes)."""
    lines = [json.dumps({"format": FORMATS[name], "config": config}, sort_keys=True)]
    lines += [f"{key}\t{json.dumps(results[key], separators=(',', ':'), sort_keys=True)}"
              for key in sorted(results)]
    path = lattice_path(name)
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                compresslevel=9) as file:
        file.write("\n".join(lines).encode("utf-8"))
    return path


class Measurements:
    """The results of one kind of measurement for one model, by setting (`values`, a dict
    of the settings the measurement depends on). Subclasses give `name` and `measure`."""

    name = ""

    def __init__(self, config: TrainConfig | None, cache: RunCache | None = None) -> None:
        self.config = config
        self.cache = RunCache() if cache is None else cache
        self.store = result_store() if self.stores_results() else None
        data = shipped(self.name)
        model = None if config is None else config.to_dict()
        # the shipped results (as JSON text), if they were measured for this model (a
        # setting newer than the file reads as its default, which is what was measured)
        measured_for = None if not data or data[0] is None else TrainConfig(**data[0]).to_dict()
        self.shipped: dict[str, str] = data[1] if data and measured_for == model else {}

    def stores_results(self) -> bool:
        """Keep results on disk? Only minipar's own measurements, whose code the store's
        fingerprint covers; a subclass defined elsewhere measures with code it cannot see."""
        return type(self).__module__.startswith("minipar.")

    def key(self, values: dict) -> tuple:
        """The result's key in a RunCache and on disk."""
        return (self.name, repr(self.config), key_text(values))

    def known(self, values: dict) -> dict | None:
        """The result if it needs no run: in the cache, shipped, or on disk."""
        key = self.key(values)
        if key in self.cache:
            return self.cache.get(key, None)
        text = self.shipped.get(key_text(values))
        result = None if text is None else json.loads(text)
        if result is None and self.store is not None:
            result = self.store.load(key)
        if result is not None:
            self.cache.get(key, lambda: result)
        return result

    def is_known(self, values: dict) -> bool:
        """`known` without reading anything (a file found is enough)."""
        key = self.key(values)
        return (key in self.cache or key_text(values) in self.shipped
                or (self.store is not None and bool(self.store.stored([key]))))

    def get(self, values: dict, looked: bool = False) -> dict:
        """The result: known, or measured now (and kept in the cache and on disk).
        looked: `known` missed just before (the disk is not read again)."""
        result = None if looked else self.known(values)
        if result is None:
            key = self.key(values)
            result = self.cache.get(key, lambda: self.measure(values))
            if self.store is not None:
                self.store.save(key, result)
        return result

    def measure(self, values: dict) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError


class TrainRuns(Measurements):
    """One training step of `config` with TRAIN_SETTINGS set: `train_summary` of it."""

    name = "train"

    def measure(self, values: dict) -> dict:
        return train_summary(train_report(self.config.replace(**values)))


class PipelineSteps(Measurements):
    """One pipeline step (`pipeline_step`: schedule, pp, micro_batches, virtual_stages)."""

    name = "pipeline"

    def __init__(self, cache: RunCache | None = None) -> None:
        super().__init__(None, cache)

    def measure(self, values: dict) -> dict:
        return pipeline_summary(pipeline_step(**values))


class ShardingLayouts(Measurements):
    """What every rank of a layout (dp, tp, pp, zero) holds: `holdings_summary`."""

    name = "sharding"

    def __init__(self, config: TrainConfig = DEFAULT_CONFIG,
                 cache: RunCache | None = None) -> None:
        super().__init__(config, cache)

    def measure(self, values: dict) -> dict:
        return holdings_summary(holdings(**values, config=self.config))
