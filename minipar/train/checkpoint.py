"""Sharded checkpoints: one `.npz` per rank and a JSON manifest, saved SPMD.

    CKPT/                       (e.g. runs/step-000010)
        rank-00000.npz          what rank 0 holds: its pieces of the parameters, master
        rank-00001.npz          weights and Adam moments (see minipar.parallel.state.Piece)
        ...
        manifest.json           format, step, config, and per file: rank, mesh coords,
                                sha256, bytes, the dropout generator state and, for every
                                array, its tensor, kind, dtype and flat range (placements);
                                and manifest_sha256, the manifest's own checksum

Every rank writes its own file (as DeepSpeed writes one optimizer-state file per DP rank);
after a barrier rank 0 checksums the files and writes the manifest. Each file appears
atomically (written to a temporary name, then renamed), and the manifest comes last, so a
directory with a manifest is a complete checkpoint.

Loading never unpickles (`np.load(..., allow_pickle=False)`): a checkpoint is data, not
code. Before any array is read the manifest is checked against its schema, its own
checksum and its config (manifest.py); then every file against its record. A missing,
truncated or altered file, or a manifest edited by hand, is a `CheckpointError` that names
it; resume and consolidate load through the same checks.
Loading assembles the full single-device tensors from the pieces whatever dp and ZeRO
stage saved them, so a checkpoint saved under one layout resumes under any other, and
`consolidate` turns one into the single-device state dict (DeepSpeed's zero_to_fp32.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minipar import distributed as dist
from minipar.autograd import placement as placements
from minipar.autograd.precision import bfloat16
from minipar.errors import CheckpointError
from minipar.parallel.state import Piece
from minipar.train.manifest import FORMAT, KINDS, SEAL, check_manifest, rank_file, seal

__all__ = ["FORMAT", "KINDS", "CheckpointError", "TrainingState", "consolidate",
           "load_checkpoint", "rank_file", "read_manifest", "save_checkpoint"]

MANIFEST = "manifest.json"
META_KEY = "__meta__"


@dataclass
class TrainingState:
    """A checkpoint read back: full single-device tensors, whatever layout saved them.

    tensors[kind][name]: kind "param", "exp_avg", "exp_avg_sq" and ("master", mixed
    precision); step: optimizer steps completed (the next batch is step's); rng_states:
    each saving rank's dropout generator state, by rank."""

    step: int
    config: dict
    tensors: dict[str, dict[str, np.ndarray]]
    rng_states: list[dict]
    world_size: int


# ------------------------------------------------------------------ saving (SPMD)
def save_checkpoint(directory, *, step: int, config: dict, pieces, coords: dict,
                    rng_state: dict, failures: list | None = None) -> Path:
    """Called by every rank: write my pieces, then rank 0 writes the manifest.

    pieces: this rank's `Piece`s (`minipar.parallel.state.state_pieces`); coords: its
    mesh coordinates; rng_state: its dropout generator's `bit_generator.state`.
    failures: a list shared by the ranks (host-side, like a log); when given, a write
    that fails (a full disk) is appended to it as (rank, path, OSError) instead of
    raised, the manifest is not written, and training goes on, so the run's results are
    not lost with the file."""
    directory = Path(directory)
    rank = dist.get_rank()

    def attempt(write) -> None:
        try:
            write()
        except OSError as err:
            if failures is None:
                raise
            failures.append((rank, directory, err))

    def prepare() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            # Saving over an older checkpoint: retire its manifest first, so that a crash
            # while the rank files are rewritten cannot leave an old manifest beside new
            # files (a directory with a manifest is a complete checkpoint).
            (directory / MANIFEST).unlink(missing_ok=True)

    attempt(prepare)
    dist.barrier()  # nobody writes a rank file while an old manifest still vouches for it
    attempt(lambda: write_rank_file(directory, rank, pieces, coords, rng_state, step=step))
    dist.barrier()  # every file is complete (or has failed) before the manifest says so
    if rank == 0 and not (failures and any(d == directory for _, d, _ in failures)):
        attempt(lambda: write_manifest(directory, step=step, config=config,
                                       world_size=dist.get_world_size()))
    dist.barrier()  # nobody goes on (or reads it) before the checkpoint is complete
    return directory


def write_rank_file(directory, rank: int, pieces, coords: dict, rng_state: dict,
                    step: int = 0) -> Path:
    """One rank's `.npz`: its arrays and a JSON description of them (`__meta__`): its
    rank, step, coords, RNG state and entries, which the manifest must repeat exactly."""
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
    meta = {"rank": rank, "step": int(step), "coords": coords, "rng_state": rng_state,
            "entries": entries}
    arrays[META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    path = Path(directory) / rank_file(rank)
    _atomic_write(path, lambda f: np.savez(f, **arrays))
    return path


def write_manifest(directory, *, step: int, config: dict, world_size: int) -> Path:
    """The manifest of a directory of rank files (checksums taken from the files)."""
    directory = Path(directory)
    files = []
    for rank in range(world_size):
        path = directory / rank_file(rank)
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(npz[META_KEY].tobytes())
        files.append({"file": path.name, "rank": rank, "coords": meta["coords"],
                      "sha256": _sha256(path), "bytes": path.stat().st_size,
                      "rng_state": meta["rng_state"], "entries": meta["entries"]})
    manifest = {"format": FORMAT, "step": int(step), "world_size": world_size,
                "config": config, "files": files}
    manifest[SEAL] = seal(manifest)
    text = json.dumps(manifest, indent=1).encode()
    path = directory / MANIFEST
    _atomic_write(path, lambda f: f.write(text))
    return path


def _atomic_write(path: Path, write) -> None:
    """Write via a temporary file in the same directory and rename it into place: a
    reader sees the old file or the complete new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _placement_to_json(placement) -> dict:
    return {"type": type(placement).__name__, **dataclasses.asdict(placement)}


def _placement_from_json(spec: dict):
    fields = {k: v for k, v in spec.items() if k != "type"}
    return getattr(placements, spec["type"])(**fields)


# ------------------------------------------------------------------ loading
def resolve(directory) -> Path:
    """A checkpoint directory, or a directory of them (step-NNNNNN): the latest one."""
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        return directory
    candidates = sorted(d for d in directory.glob("step-*") if (d / MANIFEST).exists())
    if candidates:
        return candidates[-1]
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    raise CheckpointError(f"{directory / MANIFEST}: missing; {directory} is not a minipar "
                          "checkpoint, or its save did not finish")


def read_manifest(directory) -> dict:
    """The manifest of a checkpoint, checked (schema, own checksum, agreement with its
    config: manifest.py) before anything trusts it."""
    path = resolve(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err})") from None
    check_manifest(manifest, path)
    return manifest


def load_checkpoint(directory) -> TrainingState:
    """Verify every file against the manifest and assemble the full tensors."""
    directory = resolve(directory)
    manifest = read_manifest(directory)
    held = []  # (file name, coords, Piece)
    for record in manifest["files"]:
        path = directory / record["file"]
        if not path.exists():
            raise CheckpointError(f"{path}: missing (the manifest lists it)")
        size = path.stat().st_size
        if size != record["bytes"] or _sha256(path) != record["sha256"]:
            raise CheckpointError(
                f"{path}: checksum mismatch ({size} bytes, manifest says {record['bytes']}): "
                "the file is truncated or was modified")
        try:
            with np.load(path, allow_pickle=False) as npz:
                _check_self_description(path, npz, record, manifest["step"])
                for entry in record["entries"]:
                    values = npz[entry["key"]]
                    if entry["dtype"] == "bfloat16":
                        values = values.view(bfloat16)
                    if values.shape != (entry["stop"] - entry["start"],) or \
                            values.dtype != np.dtype(bfloat16 if entry["dtype"] == "bfloat16"
                                                     else entry["dtype"]):
                        raise CheckpointError(
                            f"{path}: array {entry['key']} ({entry['kind']} of "
                            f"{entry['name']}) has shape {values.shape} dtype {values.dtype}, "
                            "the manifest says otherwise")
                    held.append((str(path), record["coords"], Piece(
                        entry["kind"], entry["name"], tuple(entry["shape"]), entry["start"],
                        entry["stop"], values, _placement_from_json(entry["placement"]),
                        entry["placement_group"])))
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - zip/format errors: name the file
            raise CheckpointError(f"{path}: cannot read ({type(err).__name__}: {err})") from None
    config = manifest["config"]
    tensors = assemble(held, config)
    return TrainingState(step=manifest["step"], config=config, tensors=tensors,
                         rng_states=[r["rng_state"] for r in manifest["files"]],
                         world_size=manifest["world_size"])


def _check_self_description(path: Path, npz, record: dict, step: int) -> None:
    """The file's own description of itself (written inside it) must be the manifest's."""
    if META_KEY not in npz.files:
        raise CheckpointError(f"{path}: no {META_KEY} record: not a minipar rank file")
    meta = json.loads(npz[META_KEY].tobytes())
    said = {"rank": record["rank"], "step": step, "coords": record["coords"],
            "rng_state": record["rng_state"], "entries": record["entries"]}
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

    config = TrainConfig.from_dict(state.config)
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
    _atomic_write(path, lambda f: np.savez(f, **arrays))
    return path
