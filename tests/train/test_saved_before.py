"""Files users saved with an earlier minipar load, read-only: checkpoints of the format
`minipar.checkpoint/2` (no run ids; each file's sha256 and bytes outside the seal) and
configs that still carry the removed `activation_checkpointing` setting (in checkpoints,
reports and traces). Each file here is written the old way: a /3 checkpoint's rank files
and manifest rewritten into the /2 shape, with the /2 seal computed as /2 computed it."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from minipar.errors import CheckpointError, ConfigError
from minipar.train import TrainConfig, train
from minipar.train import checkpoint as ckpt

SMALL = dict(seq_len=8, n_layer=2, d_model=16, n_head=2, micro_batch_size=2, steps=2,
             precision="fp32")
PROVEN = "cannot be proven to come from one run"


def seal_v2(manifest: dict) -> str:
    """minipar.checkpoint/2's seal, as it was written: the files' sha256 and bytes left out."""
    content = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    content["files"] = [{k: v for k, v in record.items() if k not in ("sha256", "bytes")}
                        for record in manifest["files"]]
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def as_v2(directory, activation_checkpointing: bool | None = False) -> None:
    """Rewrite a /3 checkpoint into what /2 wrote: no run id in the rank files' own
    description nor in the manifest, the /2 seal; the config as it was saved before
    `activation_checkpointing` was removed (None: leave the config as it is)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    for record in manifest["files"]:
        rank_path = directory / record["file"]
        with np.load(rank_path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        meta = json.loads(arrays["__meta__"].tobytes())
        del meta["run"]
        arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        rank_path.write_bytes(buffer.getvalue())
        record["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
        record["bytes"] = len(buffer.getvalue())
    del manifest["run"], manifest["origin"]
    manifest["format"] = "minipar.checkpoint/2"
    if activation_checkpointing is not None:
        config = manifest["config"]
        if activation_checkpointing:  # /2 wrote it with no granularity (its own rule)
            config["recompute_granularity"] = None
        manifest["config"] = {"activation_checkpointing": activation_checkpointing, **config}
    manifest["manifest_sha256"] = seal_v2(manifest)
    path.write_text(json.dumps(manifest, indent=1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    train(TrainConfig(dp=2, zero=1, **SMALL), save_dir=directory)
    return directory / "step-000002"


@pytest.fixture()
def old(saved, tmp_path):
    """A copy of the checkpoint, rewritten as /2 saved it (activation_checkpointing false)."""
    directory = shutil.copytree(saved, tmp_path / "step-000002")
    as_v2(directory)
    return directory


def snapshot(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_v2_checkpoint_loads_with_a_warning_and_is_not_rewritten(saved, old):
    before = snapshot(old)
    with pytest.warns(UserWarning, match=PROVEN):
        state = ckpt.load_checkpoint(old)
    assert state.step == 2 and state.origin == ""
    new = ckpt.load_checkpoint(saved)
    for kind, tensors in new.tensors.items():
        for name, array in tensors.items():
            assert np.array_equal(state.tensors[kind][name], array), (kind, name)
    with pytest.warns(UserWarning, match=PROVEN):
        assert all(np.array_equal(a, b) for a, b in zip(
            ckpt.consolidate(old).values(), ckpt.consolidate(saved).values(), strict=True))
    assert snapshot(old) == before  # read-only


def test_a_v2_checkpoint_keeps_its_seal_rules(old):
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["step"] = 1  # inside the /2 seal: refused
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ckpt.load_checkpoint(old)


def test_a_v2_rank_file_is_still_checked_against_its_record(old):
    # /2 left the sizes and checksums outside the seal: the files themselves decide
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"][1]["sha256"] = "0" * 64
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"rank-00001\.npz: checksum mismatch"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.load_checkpoint(old)


def test_a_v3_manifest_without_its_run_is_refused(saved, tmp_path):
    # only /2 goes without a run id: a /3 that lost its own is damaged, not old
    directory = shutil.copytree(saved, tmp_path / "ck")
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["run"]
    from minipar.train import manifest as schema

    manifest[schema.SEAL] = schema.seal(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="field 'run' is missing"):
        ckpt.load_checkpoint(directory)


def test_a_v2_checkpoint_with_activation_checkpointing_resumes_with_full_recompute(
        saved, tmp_path):
    directory = shutil.copytree(saved, tmp_path / "step-000002")
    as_v2(directory, activation_checkpointing=True)
    with pytest.warns(UserWarning, match=PROVEN):
        state = ckpt.load_checkpoint(directory)
    assert state.config["activation_checkpointing"] is True  # what the file says
    assert TrainConfig.from_saved(state.config).recompute_granularity == "full"
    config = TrainConfig(dp=2, zero=1, recompute_granularity="full", **{**SMALL, "steps": 3})
    with pytest.warns(UserWarning, match=PROVEN):
        report = train(config, resume_from=directory, save_dir=tmp_path / "next")
    assert [r["step"] for r in report.steps] == [2]
    resaved = json.loads((tmp_path / "next" / "step-000003" / "manifest.json").read_text())
    assert resaved["format"] == "minipar.checkpoint/3"
    assert "activation_checkpointing" not in resaved["config"]
    assert resaved["origin"] == resaved["run"]  # /2 did not say which run it continued


def test_cli_consolidates_a_v2_checkpoint_in_one_warning_line(old, tmp_path):
    result = subprocess.run([sys.executable, "-m", "minipar", "consolidate", str(old),
                             str(tmp_path / "model.npz")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minipar consolidate: warning: ")
    assert PROVEN in lines[0]
    assert "minipar.checkpoint/2, no run id; step 2" in result.stdout


@pytest.mark.parametrize("saved_value, expected", [(True, "full"), (False, None)])
def test_a_saved_activation_checkpointing_is_read_in_todays_terms(saved_value, expected):
    values = {**TrainConfig().to_dict(), "activation_checkpointing": saved_value}
    config = TrainConfig.from_saved(values)
    assert config.recompute_granularity == expected
    assert config.recompute.label == ("full" if saved_value else "none")
    assert "activation_checkpointing" in values  # the caller's dict is left as it was


def test_activation_checkpointing_with_a_granularity_was_never_valid():
    values = {**TrainConfig().to_dict(), "activation_checkpointing": True,
              "recompute_granularity": "selective"}
    with pytest.raises(ConfigError, match="^--activation-checkpointing: true"):
        TrainConfig.from_saved(values)
    with pytest.raises(ConfigError, match="must be true or false, got 'yes'"):
        TrainConfig.from_saved({**values, "activation_checkpointing": "yes"})


def test_a_trace_of_before_is_read(tmp_path):
    trace = tmp_path / "trace"
    train(TrainConfig(dp=2, **SMALL), trace=trace)
    for path in trace.glob("rank*.json"):
        data = json.loads(path.read_text())
        data["minipar"]["config"]["activation_checkpointing"] = True
        path.write_text(json.dumps(data))
    result = subprocess.run([sys.executable, "-m", "minipar", "profile", str(trace)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "unknown setting" not in result.stderr
