"""Sharded checkpoints: one `.npz` per rank and a JSON manifest, saved SPMD.

    CKPT/                       (e.g. runs/step-000010)
        rank-00000.npz          what rank 0 holds: its pieces of the parameters, master
        rank-00001.npz          weights and Adam moments (see minipar.parallel.state.Piece)
        ...
        manifest.json           format, step, run ids, config, and per file: rank, mesh
                                coords, sha256, bytes, the dropout generator state and, for
                                every array, its tensor, kind, dtype and flat range
                                (placements); and manifest_sha256, the manifest's own checksum

Every rank writes its own file (as DeepSpeed writes one optimizer-state file per DP rank);
after a barrier rank 0 checksums the files and writes the manifest. They are written into
the run's own staging directory beside CKPT, which is renamed into place once the manifest
is written (checkpoint_dirs.py), so a directory with a manifest is a complete checkpoint,
and a save that fails or is interrupted leaves the checkpoint that was there before.
Every file and the manifest carry the id of the run that wrote them.

Loading never unpickles (`np.load(..., allow_pickle=False)`): a checkpoint is data, not
code. Before any array is read the manifest is checked against its schema, its own
checksum and its config (manifest.py); then every file against its record: a regular file
no larger than its arrays can be (checked before a byte of it is read), its size and
sha256, its own description of itself (run id included). A missing, truncated, altered or
foreign file, or a manifest edited by hand, is a `CheckpointError` that names it; resume
and consolidate load through the same checks.
Loading assembles the full single-device tensors from the pieces whatever dp and ZeRO
stage saved them, so a checkpoint saved under one layout resumes under any other, and
`consolidate` turns one into the single-device state dict (DeepSpeed's zero_to_fp32.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minipar import distributed as dist
from minipar.autograd import placement as placements
from minipar.autograd.precision import bfloat16
from minipar.errors import CheckpointError, InputFileError
from minipar.files import DirectoryLock, atomic_write, loads_json, open_regular
from minipar.parallel.state import Piece
from minipar.train import checkpoint_dirs as dirs
from minipar.train.manifest import FORMAT, FORMAT_2, MANIFEST, SEAL, check_manifest, rank_file, seal

__all__ = ["CheckpointError", "TrainingState", "consolidate", "load_checkpoint",
           "read_manifest", "save_checkpoint"]

META_KEY = "__meta__"


@dataclass
class TrainingState:
    """A checkpoint read back: full single-device tensors, whatever layout saved them.

    tensors[kind][name]: kind "param", "exp_avg", "exp_avg_sq" and ("master", mixed
    precision); step: optimizer steps completed (the next batch is step's); rng_states:
    each saving rank's dropout generator state, by rank; origin: the run whose
    trajectory it is (the run that saved it, or the first one it resumed; "" for a /2
    checkpoint, which does not say)."""

    step: int
    config: dict
    tensors: dict[str, dict[str, np.ndarray]]
    rng_states: list[dict]
    world_size: int
    origin: str


# ------------------------------------------------------------------ saving (SPMD)
def save_checkpoint(directory, *, step: int, config: dict, pieces, coords: dict,
                    rng_state: dict, run: str, origin: str | None = None,
                    failures: list | None = None) -> Path:
    """Called by every rank: write my pieces, then rank 0 writes the manifest and puts
    the checkpoint in place at `directory` (replacing one saved there before).

    pieces: this rank's `Piece`s (`minipar.parallel.state.state_pieces`); coords: its
    mesh coordinates; rng_state: its dropout generator's `bit_generator.state`; run: the
    run's id (checkpoint_dirs.new_run_id(), one per run); origin: the run whose
    trajectory it continues (a resumed run: the resumed checkpoint's origin; default:
    run). failures: a list shared by the ranks (host-side, like a log); when given, a
    write that fails (a full disk) is appended to it as (rank, path, OSError) instead of
    raised, nothing is put in place, and training goes on, so the run's results are not
    lost with the file."""
    directory = Path(directory)
    rank = dist.get_rank()
    staging = dirs.staging_path(directory, run)

    def failed() -> bool:
        return bool(failures) and any(d == directory for _, d, _ in failures)

    def attempt(write) -> None:
        try:
            write()
        except OSError as err:
            if failures is None:
                raise
            failures.append((rank, directory, err))

    lock = DirectoryLock(staging)
    try:
        if rank == 0:
            attempt(lambda: dirs.begin(directory, run, lock))
        dist.barrier()  # the staging directory exists before anyone writes into it
        if not failed():
            attempt(lambda: write_rank_file(staging, rank, pieces, coords, rng_state,
                                            step=step, run=run))
        dist.barrier()  # every file is complete (or has failed) before the manifest says so
        if rank == 0 and not failed():
            attempt(lambda: write_manifest(staging, step=step, config=config,
                                           world_size=dist.get_world_size(), run=run,
                                           origin=origin or run))
            if not failed():
                attempt(lambda: dirs.commit(staging, directory, run))
    finally:  # committed, failed or interrupted (Ctrl-C, another rank's error)
        if rank == 0:
            dirs.discard(staging, lock)
    dist.barrier()  # nobody goes on (or reads it) before the checkpoint is in place
    return directory


def write_rank_file(directory, rank: int, pieces, coords: dict, rng_state: dict,
                    step: int = 0, run: str = "") -> Path:
    """One rank's `.npz`: its arrays and a JSON description of them (`__meta__`): its
    rank, step, run, coords, RNG state and entries, which the manifest must repeat."""
    arrays, entries = {}, []
    for i, piece in enumerate(pieces):
        key = f"a{i}"
        values = np.ascontiguousarray(piece.values)
        dtype = "bfloat16" if values.dtype == bfloat16 else values.dtype.str
        # NumPy cannot describe bf16 in a .npy header: store its bits as uint16.
        arrays[key] = values.view(np.uint16) if values.dtype == bfloat16 else values
        entries.append({"key": key, "kind": piece.kind, "name": piece.name, "dtype": dtype,
                        "shape": list(piece.shape), "start": int(piece.start),
                        "stop": int(piece.stop),
                        "placement": _placement_to_json(piece.placement),
                        "placement_group": piece.placement_group})
    meta = {"rank": rank, "step": int(step), "run": run, "coords": coords,
            "rng_state": rng_state, "entries": entries}
    arrays[META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    path = Path(directory) / rank_file(rank)
    with atomic_write(path) as f:
        np.savez(f, **arrays)
    return path


def write_manifest(directory, *, step: int, config: dict, world_size: int,
                   run: str = "", origin: str = "") -> Path:
    """The manifest of a directory of rank files (checksums taken from the files)."""
    directory = Path(directory)
    files = []
    for rank in range(world_size):
        path = directory / rank_file(rank)
        with open(path, "rb") as f:
            digest = _sha256(f)
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(npz[META_KEY].tobytes())
        files.append({"file": path.name, "rank": rank, "coords": meta["coords"],
                      "sha256": digest, "bytes": path.stat().st_size,
                      "rng_state": meta["rng_state"], "entries": meta["entries"]})
    manifest = {"format": FORMAT, "step": int(step), "world_size": world_size, "run": run,
                "origin": origin or run, "config": config, "files": files}
    manifest[SEAL] = seal(manifest)
    path = directory / MANIFEST
    with atomic_write(path) as f:
        f.write(json.dumps(manifest, indent=1).encode())
    return path


def _sha256(f) -> str:
    """The SHA-256 of an open binary file, read from where it is to its end."""
    return hashlib.file_digest(f, "sha256").hexdigest()


def _placement_to_json(placement) -> dict:
    return {"type": type(placement).__name__, **dataclasses.asdict(placement)}


def _placement_from_json(spec: dict):
    fields = {k: v for k, v in spec.items() if k != "type"}
    return getattr(placements, spec["type"])(**fields)


# ------------------------------------------------------------------ loading
def read_manifest(directory) -> dict:
    """The manifest of a checkpoint (or of a save directory's latest: resolve), checked
    (schema, own checksum, agreement with its config: manifest.py) before anything
    trusts it."""
    path = dirs.resolve(directory) / MANIFEST
    manifest = dirs.load_manifest(path)
    check_manifest(manifest, path)
    return manifest


def load_checkpoint(directory) -> TrainingState:
    """Verify every file against the manifest and assemble the full tensors. A FORMAT_2
    checkpoint (saved before run ids) loads with a warning: nothing proves its files come
    from one run; every other check holds, under its own seal. Nothing is rewritten."""
    directory = dirs.resolve(directory)
    manifest = read_manifest(directory)
    step, run = manifest["step"], manifest.get("run")  # (None: a /2 checkpoint)
    if manifest["format"] == FORMAT_2:
        warnings.warn(f"{directory} is a {FORMAT_2} checkpoint, saved before checkpoints "
                      "carried their run's id: it loads, but its files cannot be proven to "
                      "come from one run (two runs saving into one directory at once could "
                      "have mixed them); a new save writes " + FORMAT, stacklevel=2)
    held = []  # (file name, coords, Piece)
    for record in manifest["files"]:
        path = directory / record["file"]
        if not path.exists():
            raise CheckpointError(f"{path}: missing (the manifest lists it)")
        most = _most_bytes(record, step, run)
        if record["bytes"] > most:  # before a byte is read (a 200 GiB file: minutes)
            raise CheckpointError(f"{path}: the manifest says {record['bytes']} bytes, but "
                                  f"its arrays and their description take at most {most}")
        try:
            with open_regular(path, most, what="rank file of this checkpoint") as f:
                size = os.fstat(f.fileno()).st_size
                if size != record["bytes"] or _sha256(f) != record["sha256"]:
                    raise CheckpointError(
                        f"{path}: checksum mismatch ({size} bytes, manifest says "
                        f"{record['bytes']}): the file is truncated or was modified")
                f.seek(0)  # the file checked is the file read, even if path is replaced
                with np.load(f, allow_pickle=False) as npz:
                    _check_self_description(path, npz, _description(record, step, run))
                    held += [(str(path), record["coords"], _piece(path, npz, entry))
                             for entry in record["entries"]]
        except (CheckpointError, InputFileError) as err:
            raise CheckpointError(str(err)) from None
        except Exception as err:  # noqa: BLE001 - zip/format errors: name the file
            raise CheckpointError(f"{path}: cannot read ({type(err).__name__}: {err})") from None
    config = manifest["config"]
    tensors = assemble(held, config)
    return TrainingState(step=step, config=config, tensors=tensors,
                         rng_states=[r["rng_state"] for r in manifest["files"]],
                         world_size=manifest["world_size"],
                         origin=manifest.get("origin", ""))


def _piece(path: Path, npz, entry: dict) -> Piece:
    """The Piece an entry of the manifest describes, read from the file's arrays."""
    values = npz[entry["key"]]
    dtype = bfloat16 if entry["dtype"] == "bfloat16" else np.dtype(entry["dtype"])
    if entry["dtype"] == "bfloat16":
        values = values.view(bfloat16)
    if values.shape != (entry["stop"] - entry["start"],) or values.dtype != dtype:
        raise CheckpointError(f"{path}: array {entry['key']} ({entry['kind']} of "
                              f"{entry['name']}) has shape {values.shape} dtype "
                              f"{values.dtype}, the manifest says otherwise")
    return Piece(entry["kind"], entry["name"], tuple(entry["shape"]), entry["start"],
                 entry["stop"], values, _placement_from_json(entry["placement"]),
                 entry["placement_group"])


def _description(record: dict, step: int, run: str | None) -> dict:
    """What a rank file says of itself (write_rank_file's `__meta__`), per the manifest
    (run None: a /2 file, which has no run id)."""
    said = {"rank": record["rank"], "step": step, "run": run, "coords": record["coords"],
            "rng_state": record["rng_state"], "entries": record["entries"]}
    if run is None:
        del said["run"]
    return said


def _most_bytes(record: dict, step: int, run: str | None) -> int:
    """The largest a rank file holding `record`'s arrays can be: their bytes, their
    description (`__meta__`) and, per array, NumPy's .npy header (128 bytes for a flat
    array) and zip's local and central headers with their ZIP64 fields (np.savez), which
    1 KiB covers with room to spare."""
    data = sum((e["stop"] - e["start"]) * (2 if e["dtype"] == "bfloat16" else
                                           np.dtype(e["dtype"]).itemsize)
               for e in record["entries"])
    meta = len(json.dumps(_description(record, step, run)).encode())
    return data + meta + 1024 * (len(record["entries"]) + 2)


def _check_self_description(path: Path, npz, said: dict) -> None:
    """The file's own description of itself (written inside it) must be the manifest's."""
    if META_KEY not in npz.files:
        raise CheckpointError(f"{path}: no {META_KEY} record: not a minipar rank file")
    meta = loads_json(npz[META_KEY].tobytes(), path, what="rank file's description")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: its {META_KEY} record is not a JSON object")
    if "run" in said and meta.get("run") != said["run"]:
        raise CheckpointError(f"{path}: written by run {meta.get('run')!r}, but the "
                              f"manifest is run {said['run']!r}'s: the checkpoint mixes "
                              "the files of two runs (saved into one directory at once?)")
    for name, value in said.items():
        if meta.get(name) != value:
            raise CheckpointError(f"{path}: the file says {name}={meta.get(name)!r}, the "
                                  f"manifest says {value!r}")


def assemble(held, config: dict, strict: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """Full tensors {kind: {name: array}} from what the ranks held.

    held: (label, mesh coords, Piece) triples; label names the file (or rank) in errors.
    Each rank's pieces fill flat ranges of its local tensor; local tensors that are
    shards over a group (tensor parallelism) are then joined by their placement. Every
    element must be covered; overlapping pieces (replicas) and the copies of a tensor
    replicated over a group must agree, unless not `strict` (then the first one counts:
    an equivalence check reports the difference)."""
    local: dict[tuple, dict] = {}  # (kind, name, group index) -> flat, filled, piece
    for label, coords, piece in held:
        group = piece.placement_group
        index = coords.get(group, 0) if group else 0
        key = (piece.kind, piece.name, index)
        slot = local.get(key)
        if slot is None:
            size = int(np.prod(piece.shape, dtype=np.int64))
            slot = local[key] = {"flat": np.zeros(size, piece.values.dtype),
                                 "filled": np.zeros(size, bool), "piece": piece}
        lo, hi, values = piece.start, piece.stop, piece.values
        seen = slot["filled"][lo:hi]
        if seen.any() and not np.array_equal(slot["flat"][lo:hi][seen], values[seen]):
            if strict:
                raise CheckpointError(f"{label}: {piece.kind} of {piece.name} differs from "
                                      "another rank's copy of the same elements")
            values = np.where(seen, slot["flat"][lo:hi], values)
        slot["flat"][lo:hi] = values
        slot["filled"][lo:hi] = True
    by_tensor: dict[tuple, dict[int, dict]] = {}
    for (kind, name, index), slot in local.items():
        if not slot["filled"].all():
            missing = int((~slot["filled"]).sum())
            raise CheckpointError(f"{kind} of {name}: {missing} elements are held by no "
                                  "rank (no file of the checkpoint has them)")
        by_tensor.setdefault((kind, name), {})[index] = slot
    tensors: dict[str, dict[str, np.ndarray]] = {}
    for (kind, name), slots in by_tensor.items():
        arrays = [slots[i]["flat"].reshape(slots[i]["piece"].shape) for i in sorted(slots)]
        piece = slots[min(slots)]["piece"]
        if isinstance(piece.placement, placements.Replicate):
            full = arrays[0]
            if strict:
                _check_replicas(kind, name, piece.placement_group, arrays)
        else:
            count = config.get(piece.placement_group, len(arrays))
            if len(arrays) != count:
                raise CheckpointError(f"{kind} of {name}: {len(arrays)} of {count} "
                                      f"{piece.placement_group} shards were found")
            full = placements.unshard(arrays, piece.placement)
        tensors.setdefault(kind, {})[name] = full
    return tensors


def _check_replicas(kind: str, name: str, group: str | None, arrays) -> None:
    """Copies of a Replicate() tensor over a group (TP) must be bit-identical: a copy
    that differs means a gradient reduction is missing on some rank."""
    for index, array in enumerate(arrays[1:], start=1):
        if not np.array_equal(array, arrays[0]):
            difference = np.max(np.abs(array.astype(np.float64) - arrays[0]))
            raise CheckpointError(
                f"{kind} of {name} is Replicate() over the {group.upper()} group but "
                f"{group.upper()} rank {index} holds different values than rank 0 (max "
                f"difference {difference:.3g}): its gradient was not reduced the same way on "
                "every rank")


def consolidate(directory) -> dict[str, np.ndarray]:
    """The single-device state dict of a checkpoint (`GPT.state_dict()`'s names and shapes).

    For mixed precision these are the fp32 master weights, the precise values the bf16
    parameters are rounded from (as DeepSpeed's zero_to_fp32.py); otherwise the
    parameters themselves."""
    state = load_checkpoint(directory)
    weights = state.tensors.get("master") or state.tensors["param"]
    from minipar.nn.gpt import parameter_shapes
    from minipar.train.config import TrainConfig, gpt_config

    config = TrainConfig.from_saved(state.config)
    return in_model_order(weights, parameter_shapes(gpt_config(config, config.vocab_size)),
                          f"{directory}: the checkpoint")


def in_model_order(weights: dict[str, np.ndarray], shapes: dict,
                   source: str = "the ranks") -> dict[str, np.ndarray]:
    """`weights` (e.g. `assemble(...)["param"]`) keyed in the single-device GPT's order
    (`parameter_shapes`); raises if a parameter is missing or not the model's."""
    if set(shapes) != set(weights):
        raise CheckpointError(f"{source} holds {sorted(weights)}, the model of its config "
                              f"has {sorted(shapes)}")
    return {name: weights[name] for name in shapes}


def save_state_dict(path, state_dict: dict[str, np.ndarray]) -> Path:
    """Write a state dict as one .npz (atomically; bf16 arrays as fp32)."""
    path = Path(path)
    arrays = {name: (a.astype(np.float32) if a.dtype == bfloat16 else a)
              for name, a in state_dict.items()}
    with atomic_write(path) as f:
        np.savez(f, **arrays)
    return path
