"""Sharded checkpoints: bit-identical resume, resharding to another dp / ZeRO layout,
consolidation to the single-device state dict, and clear errors for damaged files."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from minipar.errors import CheckpointError
from minipar.nn import GPT, GPTConfig, parameter_shapes
from minipar.train import ConfigError, TrainConfig, train
from minipar.train import checkpoint as ckpt

SMALL = dict(seq_len=8, n_layer=1, d_model=16, n_head=2, micro_batch_size=2, steps=4,
             grad_clip=0.05)


def assert_same_run(resumed, full, from_step):
    assert [s["step"] for s in resumed.steps] == list(range(from_step, len(full.steps)))
    assert resumed.steps == full.steps[from_step:]  # losses, lr, grad norms: bit for bit
    for name, value in full.state_dict.items():
        assert np.array_equal(resumed.state_dict[name], value), name


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_resume_continues_bit_identically(tmp_path, zero):
    # dropout: the resumed run must also draw the same masks (generator state restored)
    config = TrainConfig(dp=2, zero=zero, grad_accum_steps=2, precision="bf16-mixed",
                         dropout=0.1, **SMALL)
    full = train(config, save_dir=tmp_path, save_every=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000004"]
    resumed = train(config, resume_from=tmp_path / "step-000002")
    assert_same_run(resumed, full, 2)
    # the final checkpoint holds the final weights (bf16 params; fp32 master weights)
    state = ckpt.load_checkpoint(tmp_path)  # a save directory means its latest checkpoint
    assert state.step == 4
    for name, value in full.state_dict.items():
        assert np.array_equal(state.tensors["param"][name], value)
        assert state.tensors["master"][name].dtype == np.float32


def test_a_checkpoint_loads_under_another_layout_and_continues_equivalently(tmp_path):
    config = TrainConfig(precision="fp64", global_batch_size=8, **SMALL)
    single = train(config)  # the uninterrupted single-device run
    train(config.replace(dp=2, zero=1, global_batch_size=8), save_dir=tmp_path,
          save_every=2)
    for dp, zero in [(4, 3), (1, 0), (2, 2)]:
        resumed = train(config.replace(dp=dp, zero=zero, global_batch_size=8),
                        resume_from=tmp_path / "step-000002")
        np.testing.assert_allclose(resumed.losses, single.losses[2:], rtol=1e-10)
        for name, value in single.state_dict.items():
            np.testing.assert_allclose(resumed.state_dict[name], value, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_consolidate_gives_the_single_device_state_dict(tmp_path, zero):
    config = TrainConfig(dp=3, zero=zero, precision="fp64", **{**SMALL, "steps": 2})
    report = train(config, save_dir=tmp_path)
    state_dict = ckpt.consolidate(tmp_path / "step-000002")
    shapes = parameter_shapes(GPTConfig(vocab_size=report.config["vocab_size"], seq_len=8,
                                        n_layer=1, n_head=2, d_model=16))
    assert list(state_dict) == list(shapes)
    assert {k: v.shape for k, v in state_dict.items()} == shapes
    for name, value in report.state_dict.items():
        assert np.array_equal(state_dict[name], value)
    # and the single-device model takes it as it is
    model = GPT(GPTConfig(vocab_size=report.config["vocab_size"], seq_len=8, n_layer=1,
                          n_head=2, d_model=16))
    model.load_state_dict(state_dict)


def test_files_manifest_and_sharding(tmp_path):
    train(TrainConfig(dp=4, zero=2, precision="fp32", **{**SMALL, "steps": 1}),
          save_dir=tmp_path)
    directory = tmp_path / "step-000001"
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["manifest.json"] + [f"rank-{r:05d}.npz" for r in range(4)]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["config"]["zero"] == 2
    assert manifest["world_size"] == 4
    for record in manifest["files"]:
        assert len(record["sha256"]) == 64 and record["bytes"] > 0
        assert record["coords"] == {"dp": record["rank"], "pp": 0, "tp": 0}
        assert {e["kind"] for e in record["entries"]} == {"param", "exp_avg", "exp_avg_sq"}
    # ZeRO: every element of every tensor is saved once, by the rank that owns it
    n_params = sum(e["stop"] - e["start"] for r in manifest["files"] for e in r["entries"]
                   if e["kind"] == "param")
    assert n_params == sum(int(np.prod(s)) for s in parameter_shapes(GPTConfig(
        vocab_size=manifest["config"]["vocab_size"], seq_len=8, n_layer=1, n_head=2,
        d_model=16)).values())


# ------------------------------------------------------------------ damaged checkpoints
@pytest.fixture()
def saved(tmp_path):
    train(TrainConfig(dp=2, zero=1, precision="fp32", **{**SMALL, "steps": 2}),
          save_dir=tmp_path)
    return tmp_path / "step-000002"


def test_a_missing_file_is_named(saved):
    (saved / "rank-00001.npz").unlink()
    with pytest.raises(CheckpointError, match=r"rank-00001\.npz: missing"):
        ckpt.load_checkpoint(saved)


def test_a_truncated_file_is_named(saved):
    path = saved / "rank-00000.npz"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"rank-00000\.npz: checksum mismatch"):
        ckpt.load_checkpoint(saved)


def test_a_file_from_another_checkpoint_is_named(saved, tmp_path):
    train(TrainConfig(dp=2, zero=1, precision="fp32", seed=1, **{**SMALL, "steps": 2}),
          save_dir=tmp_path / "other")
    other = tmp_path / "other" / "step-000002" / "rank-00001.npz"
    (saved / "rank-00001.npz").write_bytes(other.read_bytes())
    with pytest.raises(CheckpointError, match=r"rank-00001\.npz: checksum mismatch"):
        ckpt.load_checkpoint(saved)


def test_a_directory_without_manifest_is_not_a_checkpoint(saved):
    (saved / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing"):
        ckpt.load_checkpoint(saved)


def test_loading_never_unpickles(saved):
    """An object array (which would need pickle) is refused even with a valid checksum."""
    path = saved / "rank-00000.npz"
    with np.load(path, allow_pickle=False) as npz:
        arrays = dict(npz)
    arrays["a0"] = np.array([{"evil": 1}], dtype=object)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"][0]["sha256"] = ckpt._sha256(path)
    manifest["files"][0]["bytes"] = path.stat().st_size
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"rank-00000\.npz: cannot read.*pickle"):
        ckpt.load_checkpoint(saved)


def test_resuming_a_different_model_names_the_setting(saved):
    with pytest.raises(ConfigError, match="--d-model: the checkpoint .* d_model=16"):
        train(TrainConfig(precision="fp32", **{**SMALL, "d_model": 32}), resume_from=saved)
    with pytest.raises(ConfigError, match="--steps"):
        train(TrainConfig(precision="fp32", **{**SMALL, "steps": 2}), resume_from=saved)


def test_writes_are_atomic(tmp_path, monkeypatch):
    """A write that fails half-way leaves the previous file untouched and no debris."""
    path = tmp_path / "state.npz"
    ckpt.save_state_dict(path, {"w": np.ones(3)})
    before = path.read_bytes()

    def broken_savez(f, **arrays):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_state_dict(path, {"w": np.zeros(3)})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["state.npz"]


def test_tensor_parallel_shards_are_joined_by_their_placement():
    """Consolidation reads placements: two tp ranks holding Shard(1) halves of a matrix,
    each split further into ZeRO flat ranges, give back the full matrix."""
    from minipar.autograd.placement import Shard
    from minipar.parallel.state import Piece

    full = np.arange(24.0).reshape(4, 6)
    held = []
    for tp in range(2):
        local = full[:, 3 * tp:3 * tp + 3].reshape(-1)  # (4, 3) local shard, flattened
        for lo, hi in ((0, 5), (5, 12)):  # two dp ranks' ZeRO pieces
            held.append((f"tp{tp}", {"dp": lo // 5, "pp": 0, "tp": tp},
                         Piece("param", "w", (4, 3), lo, hi, local[lo:hi], Shard(1), "tp")))
    tensors = ckpt.assemble(held, {"tp": 2})
    np.testing.assert_array_equal(tensors["param"]["w"], full)
    with pytest.raises(CheckpointError, match="elements are held by no rank"):
        ckpt.assemble(held[:-1], {"tp": 2})


# ------------------------------------------------------------------ the command line
def test_cli_saves_resumes_and_consolidates(tmp_path):
    flags = ["--seq-len", "8", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
             "--micro-batch-size", "2", "--steps", "3", "--precision", "fp64", "--quiet"]

    def run(*args):
        result = subprocess.run([sys.executable, "-m", "minipar.cli", *args],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result

    run("train", "--dp", "2", "--zero", "3", *flags, "--save", str(tmp_path / "ck"),
        "--save-every", "1", "--json", str(tmp_path / "full.json"))
    run("train", "--dp", "4", "--zero", "1", *flags, "--micro-batch-size", "1", "--resume",
        str(tmp_path / "ck" / "step-000001"), "--json", str(tmp_path / "resumed.json"))
    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    np.testing.assert_allclose([s["loss"] for s in resumed["steps"]],
                               [s["loss"] for s in full["steps"][1:]], rtol=1e-10)
    out = tmp_path / "model.npz"
    result = run("consolidate", str(tmp_path / "ck"), str(out))
    assert "single-device names" in result.stdout
    with np.load(out, allow_pickle=False) as npz:
        assert "h.0.attn.c_attn.weight" in npz.files and "wte.weight" in npz.files
    bad = subprocess.run([sys.executable, "-m", "minipar.cli", "consolidate",
                          str(tmp_path / "nowhere"), str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "nowhere" in bad.stderr and "Traceback" not in bad.stderr


def test_a_failed_save_over_an_old_checkpoint_leaves_no_manifest(tmp_path, monkeypatch):
    """Re-saving into the same step directory retires the old manifest before any rank
    file is rewritten, so a crash cannot leave an old manifest beside new files."""
    config = TrainConfig(dp=2, zero=1, precision="fp32", **SMALL)
    train(config, save_dir=tmp_path)
    (step_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (step_dir / ckpt.MANIFEST).exists()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "write_rank_file", crash)
    with pytest.raises(OSError, match="disk full"):
        train(config, save_dir=tmp_path)
    assert not (step_dir / ckpt.MANIFEST).exists()
    with pytest.raises(CheckpointError):
        ckpt.load_checkpoint(step_dir)


def test_resuming_with_other_optimizer_settings_warns_but_goes_on(saved):
    with pytest.warns(UserWarning, match="--lr 0.002 .*saved with 0.001"):
        report = train(TrainConfig(dp=2, zero=1, precision="fp32", **{**SMALL, "lr": 2e-3}),
                       resume_from=saved)
    assert len(report.steps) > 0


def test_resuming_with_another_dropout_warns_too(saved):
    """A fuzzer's case: a changed --dropout changes the trajectory as a changed --lr does,
    and went unsaid."""
    with pytest.warns(UserWarning, match="--dropout 0.1 .*saved with 0.0"):
        train(TrainConfig(dp=2, zero=1, precision="fp32", **{**SMALL, "dropout": 0.1}),
              resume_from=saved)


@pytest.mark.parametrize("settings", [dict(zero=1, offload_optimizer="cpu"),
                                      dict(zero=3, offload_optimizer="nvme",
                                           offload_param="cpu")])
def test_an_offloaded_run_saves_and_resumes_bit_identically(tmp_path, settings):
    """Offloaded optimizer state (host or NVMe tier) goes into the same sharded
    checkpoint, and a resumed run continues exactly; a checkpoint saved without offload
    resumes offloaded too (the tier is where the state lives, not what it is)."""
    config = TrainConfig(dp=2, grad_accum_steps=2, precision="bf16-mixed", **SMALL, **settings)
    full = train(config, save_dir=tmp_path / "offloaded", save_every=2)
    resumed = train(config, resume_from=tmp_path / "offloaded" / "step-000002")
    assert_same_run(resumed, full, 2)
    # across tiers in fp64, where offload is bit-identical to the GPU (in bf16 it clips
    # the fp32 host gradient, as DeepSpeed does, so the two runs differ in the last bits)
    exact = config.replace(precision="fp64")
    offloaded = train(exact)
    train(exact.replace(offload_optimizer="none", offload_param="none"),
          save_dir=tmp_path / "on_gpu", save_every=2)
    across = train(exact, resume_from=tmp_path / "on_gpu" / "step-000002")
    assert_same_run(across, offloaded, 2)
