"""A checkpoint's manifest: its schema, its own checksum, and what it must agree with.

A manifest is data a user can open in a text editor, so none of it is trusted. Before
any array is read (checkpoint.load_checkpoint, hence resume and `minipar consolidate`):

1. schema: every field present with its type and range (`step` an integer >= 0, `run`
   the id of the run that saved it, `origin` the run whose trajectory it is (itself, or
   the first run it resumed), `files` a list of one record per rank, each entry a
   known kind, dtype, shape and range, each placement one of Replicate / Shard(dim) /
   StridedShard(dim, stride) with a dim inside the shape, each RNG state a PCG64 state
   NumPy accepts);
2. seal: `manifest_sha256` is the SHA-256 of the manifest's own content (all of it but
   the seal, each file's sha256 and size included), so a hand edit of `step`,
   `world_size`, `config`, an entry or a file's size is caught even when it is
   well-formed;
3. agreement with the config it carries: a valid TrainConfig (no unknown field),
   world_size = dp x tp x pp, each file's mesh coordinates those of its rank, every
   tensor of the config's model present in every kind the precision keeps (and nothing
   else), each local shape the full shape or its 1/tp shard along the placement's dim,
   each dtype the one the precision stores, and every element of every local tensor held
   by exactly one data-parallel rank (ZeRO; every replica under plain DP: dp of them,
   dp / ep of an expert's).

Then checkpoint.py checks each file against its record (size, at most what its arrays
can take, before a byte is read; sha256; and the file's own description of itself,
written inside it, equal to the record, its run id included: the files of another run
saved into the same directory are refused).
Like DeepSpeed's `zero_to_fp32.py`, which reads the partition counts and shapes from the
saved metadata and asserts them, but here everything is checked before the first array.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from minipar import distributed as dist
from minipar.errors import CheckpointError, ConfigError
from minipar.train.config import TrainConfig

# /1 had no manifest checksum; /2 no run id and the files' sizes outside the seal
FORMAT = "minipar.checkpoint/3"
# Read, never written: the checkpoints users saved before run ids. Their files cannot be
# proven to come from one run (checkpoint.load_checkpoint says so); their seal is theirs.
FORMAT_2 = "minipar.checkpoint/2"
MANIFEST = "manifest.json"
KINDS = ("param", "master", "exp_avg", "exp_avg_sq")
PLACEMENTS = {"Replicate": (), "Shard": ("dim",), "StridedShard": ("dim", "stride")}
GROUPS = (None, "dp", "pp", "tp")
SEAL = "manifest_sha256"
JSON_TYPES = {int: "an integer", str: "a string", dict: "an object", list: "a list"}


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.npz"


def stored_dtype(precision: str, kind: str) -> str:
    """The dtype a checkpoint stores `kind` in under `precision` (bf16-mixed: bf16
    parameters, fp32 master weights and moments; the ZeRO paper's 2 + 12 bytes)."""
    if precision == "bf16-mixed":
        return "bfloat16" if kind == "param" else "<f4"
    return {"fp64": "<f8", "fp32": "<f4"}[precision]


def seal(manifest: dict) -> str:
    """SHA-256 of the manifest's content: every field but the seal itself, in canonical
    JSON (a /2 manifest's: without each file's sha256 and bytes, as /2 sealed it)."""
    content = {k: v for k, v in manifest.items() if k != SEAL}
    if manifest.get("format") == FORMAT_2:
        content["files"] = [{k: v for k, v in record.items() if k not in ("sha256", "bytes")}
                            if isinstance(record, dict) else record
                            for record in manifest.get("files", [])]
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------ 1. schema
def _integer(value, where: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CheckpointError(f"{where} must be an integer >= {low}, got {value!r}")
    return value


def _field(record: dict, name: str, kind, where: str):
    if name not in record:
        raise CheckpointError(f"{where}: field {name!r} is missing")
    value = record[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{where}.{name} must be {JSON_TYPES[kind]}, got {value!r}")
    return value


def check_schema(manifest, path) -> None:
    """Raise CheckpointError naming the first field of `manifest` that is missing, of the
    wrong type or out of range."""
    where = str(path)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: a manifest is a JSON object, got a "
                              f"{type(manifest).__name__}")
    if manifest.get("format") not in (FORMAT, FORMAT_2):
        raise CheckpointError(f"{where}: format {manifest.get('format')!r}, expected "
                              f"{FORMAT!r} (or {FORMAT_2!r}, read too)")
    runs = (("run", str), ("origin", str)) if manifest["format"] == FORMAT else ()
    for name, kind in (("step", int), ("world_size", int), *runs, ("config", dict),
                       ("files", list), (SEAL, str)):
        _field(manifest, name, kind, where)
    _integer(manifest["step"], f"{where}: step")
    _integer(manifest["world_size"], f"{where}: world_size", 1)
    for i, record in enumerate(manifest["files"]):
        at = f"{where}: files[{i}]"
        if not isinstance(record, dict):
            raise CheckpointError(f"{at} must be an object, got {record!r}")
        for name, kind in (("file", str), ("rank", int), ("coords", dict), ("sha256", str),
                           ("bytes", int), ("rng_state", dict), ("entries", list)):
            _field(record, name, kind, at)
        for name in ("dp", "pp", "tp"):
            _integer(record["coords"].get(name), f"{at}.coords.{name}")
        _check_rng_state(record["rng_state"], at)
        for j, entry in enumerate(record["entries"]):
            _check_entry(entry, f"{at}.entries[{j}]")


def _check_rng_state(state: dict, at: str) -> None:
    """NumPy itself decides whether the dropout generator's saved state is one."""
    try:
        np.random.PCG64().state = state
    except Exception as err:  # noqa: BLE001 - TypeError, ValueError, KeyError: all bad data
        raise CheckpointError(f"{at}.rng_state is not a PCG64 generator state "
                              f"({type(err).__name__}: {err})") from None


def _check_entry(entry, at: str) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{at} must be an object, got {entry!r}")
    for name, kind in (("key", str), ("kind", str), ("name", str), ("dtype", str),
                       ("shape", list), ("start", int), ("stop", int), ("placement", dict)):
        _field(entry, name, kind, at)
    if entry["kind"] not in KINDS:
        raise CheckpointError(f"{at}.kind {entry['kind']!r} is not one of {KINDS}")
    for n in entry["shape"]:
        _integer(n, f"{at}.shape", 1)
    size = int(np.prod(entry["shape"], dtype=np.int64))
    start, stop = _integer(entry["start"], f"{at}.start"), _integer(entry["stop"], f"{at}.stop")
    if not start < stop <= size:
        raise CheckpointError(f"{at}: range [{start}, {stop}) is not a non-empty range of "
                              f"the {size} elements of shape {entry['shape']}")
    placement = entry["placement"]
    fields = PLACEMENTS.get(placement.get("type"))
    if fields is None or set(placement) != {"type", *fields}:
        raise CheckpointError(f"{at}.placement {placement!r} is not one of Replicate, "
                              "Shard(dim), StridedShard(dim, stride)")
    if "dim" in fields:
        dim = _integer(placement["dim"], f"{at}.placement.dim")
        if dim >= len(entry["shape"]):
            raise CheckpointError(f"{at}.placement.dim {dim} is not a dimension of shape "
                                  f"{entry['shape']}")
    if "stride" in fields:
        _integer(placement["stride"], f"{at}.placement.stride", 1)
    if entry.get("placement_group") not in GROUPS:
        raise CheckpointError(f"{at}.placement_group {entry.get('placement_group')!r} is not "
                              f"one of {GROUPS}")


# ------------------------------------------------------------------ 2. + 3. seal, agreement
def check_manifest(manifest, path) -> TrainConfig:
    """Schema, seal and agreement with its config (module docstring); returns the config."""
    check_schema(manifest, path)
    if manifest[SEAL] != seal(manifest):
        raise CheckpointError(f"{path}: manifest checksum mismatch: the manifest was edited "
                              "after it was saved (its step, config, world size, an entry or "
                              "a file's size or checksum no longer match what was written)")
    try:
        config = TrainConfig.from_saved(manifest["config"])
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: config: {err}") from None
    if config.vocab_size is None:
        raise CheckpointError(f"{path}: config.vocab_size is missing (a saved run knows it)")
    files = manifest["files"]
    if manifest["world_size"] != config.world_size or len(files) != config.world_size:
        raise CheckpointError(
            f"{path}: world_size {manifest['world_size']} and {len(files)} file(s), but the "
            f"config's mesh is dp x tp x pp = {config.dp} x {config.tp} x {config.pp} = "
            f"{config.world_size} ranks")
    mesh = dist.DeviceMesh(config.dp, config.pp, config.tp, cp=config.cp,
                           world_size=config.world_size, gpus_per_node=config.gpus_per_node)
    for rank, record in enumerate(files):
        expected = {"file": rank_file(rank), "rank": rank, "coords": mesh.coords(rank)}
        actual = {k: record[k] for k in expected}
        if actual != expected:
            raise CheckpointError(f"{path}: files[{rank}] is {actual}, expected {expected}")
    _check_tensors(manifest, config, path)
    return config


def _coverage(ranges: list[tuple[int, int]], size: int):
    """(first element, copies) of each run of elements of [0, size) held by the same
    number of the `ranges` (a sweep over their ends: no array of `size` elements)."""
    change: dict[int, int] = {0: 0, size: 0}
    for start, stop in ranges:
        change[start] = change.get(start, 0) + 1
        change[stop] = change.get(stop, 0) - 1
    held = 0
    for position in sorted(change)[:-1]:
        held += change[position]
        yield position, held


def _check_tensors(manifest: dict, config: TrainConfig, path) -> None:
    """Names, kinds, shapes and dtypes from the config; every element held exactly once
    per sharding group: by every replica (dp x cp) under ZeRO-0, once under ZeRO-1/2/3,
    once per HSDP shard group (the replicas over it hold one copy each)."""
    from minipar.nn.gpt import parameter_shapes
    from minipar.train.config import gpt_config

    full = parameter_shapes(gpt_config(config, config.vocab_size))
    kinds = ["param", "exp_avg", "exp_avg_sq"] + (["master"] if config.precision ==
                                                   "bf16-mixed" else [])
    slots: dict[tuple, dict] = {}  # (kind, name, shard index) -> shape, copies, stages
    for i, record in enumerate(manifest["files"]):
        for j, entry in enumerate(record["entries"]):
            at = f"{path}: files[{i}].entries[{j}] ({entry['kind']} of {entry['name']})"
            name, kind, shape = entry["name"], entry["kind"], tuple(entry["shape"])
            if name not in full or kind not in kinds:
                raise CheckpointError(f"{at}: the {config.precision} model of the config "
                                      f"has no such tensor (kinds {kinds})")
            dtype = stored_dtype(config.precision, kind)
            if entry["dtype"] != dtype:
                raise CheckpointError(f"{at}: dtype {entry['dtype']!r}, but "
                                      f"{config.precision} stores {dtype!r}")
            placement, group = entry["placement"], entry["placement_group"]
            local = list(full[name])
            if placement["type"] != "Replicate":
                parts = getattr(config, group) if group else 1
                if local[placement["dim"]] % parts:
                    raise CheckpointError(f"{at}: dim {placement['dim']} of {full[name]} "
                                          f"does not split over {group}={parts}")
                local[placement["dim"]] //= parts
            if list(shape) != local:
                raise CheckpointError(f"{at}: local shape {list(shape)}, but the config's "
                                      f"model gives {local} (full shape {list(full[name])}, "
                                      f"placement {placement['type']})")
            index = record["coords"].get(group, 0) if group else 0
            slot = slots.setdefault((kind, name, index), {
                "size": int(np.prod(shape)), "ranges": [], "stages": set()})
            slot["ranges"].append((entry["start"], entry["stop"]))
            slot["stages"].add(record["coords"]["pp"])
    for (kind, name, index), slot in slots.items():
        # ZeRO-0: every replica (dp x cp: context parallelism replicates the parameters)
        # saves its copy, of an expert (--ep) only the dp / ep ranks of its
        # expert-data-parallel group; ZeRO: one copy per sharding group (HSDP's replicas
        # of its shard group each save theirs).
        replicas = config.replicas // (config.sharding_group if config.zero else 1)
        if not config.zero and ".mlp.experts." in name:
            replicas //= config.ep
        # A tied embedding lives on the first and the last pipeline stage: one copy each.
        expected = replicas * len(slot["stages"])
        for start, held in _coverage(slot["ranges"], slot["size"]):
            if held != expected:
                raise CheckpointError(
                    f"{path}: {kind} of {name} (shard {index}): element {start} is held "
                    f"{held} time(s), expected {expected} (dp={config.dp}, cp={config.cp}, "
                    f"ZeRO-{config.zero}): a shard's start/stop was changed")
    for kind in kinds:
        missing = sorted(n for n in full if not any(k[:2] == (kind, n) for k in slots))
        if missing:
            raise CheckpointError(f"{path}: no file holds {kind} of {missing[0]}"
                                  f"{' ...' if len(missing) > 1 else ''}")
