"""Sharded checkpoints: bit-identical resume, resharding to another dp / ZeRO layout,
consolidation to the single-device state dict, and clear errors for damaged files."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.errors import CheckpointError, ConfigError
from minipar.nn import GPT, GPTConfig, parameter_shapes
from minipar.train import TrainConfig, train
from minipar.train import checkpoint as ckpt
from minipar.train import manifest as schema

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


@pytest.mark.parametrize("settings", [
    dict(dp=2, cp=2, zero=0),  # context parallelism replicates the parameters too
    dict(dp=1, cp=2, tp=2, zero=0),
    dict(dp=4, zero=3, hsdp_shard_size=2),  # each of HSDP's 2 replicas saves its shards
], ids=["dp2 cp2", "cp2 tp2", "hsdp 2 of dp4"])
def test_a_checkpoint_whose_parameters_have_more_replicas_than_dp_resumes(tmp_path,
                                                                         settings):
    # every replica of ZeRO-0 (dp x cp of them) and every HSDP replica group saves its
    # copy: the manifest's check counts them, and the run resumes bit for bit
    config = TrainConfig(precision="fp64", **{**SMALL, "steps": 2, **settings})
    full = train(config, save_dir=tmp_path, save_every=1)
    resumed = train(config, resume_from=tmp_path / "step-000001")
    assert_same_run(resumed, full, 1)
    consolidated = ckpt.consolidate(tmp_path / "step-000002")
    for name, value in full.state_dict.items():
        assert np.array_equal(consolidated[name], value)


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
    manifest["files"][0]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest["files"][0]["bytes"] = path.stat().st_size
    manifest[schema.SEAL] = schema.seal(manifest)  # the seal covers sha256 and bytes
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"rank-00000\.npz: cannot read.*pickle"):
        ckpt.load_checkpoint(saved)


def resealed(directory, edit):
    """Edit the manifest and fix its seal, as a determined hand would."""
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    manifest[schema.SEAL] = schema.seal(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_file_size_edited_into_the_manifest_breaks_its_seal(saved):
    """`bytes` and `sha256` are under the seal: an edited size is refused before the
    file it points at is read (a sparse file that size took minutes to hash)."""
    path = saved / "rank-00000.npz"
    with open(path, "r+b") as f:
        f.truncate(2 * 2**30)  # 2 GiB, sparse
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"][0]["bytes"] = 2 * 2**30
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        ckpt.load_checkpoint(saved)


def test_a_rank_file_larger_than_its_arrays_is_not_read(saved):
    """Resealed, the size still has to fit what the file's arrays can take: a 200 GiB
    file is refused from its record, before a byte of it is read."""
    path = saved / "rank-00000.npz"
    with open(path, "r+b") as f:
        f.truncate(200 * 2**30)  # sparse: nothing written
    resealed(saved, lambda m: m["files"][0].update(bytes=200 * 2**30))
    with pytest.raises(CheckpointError, match=r"rank-00000\.npz: the manifest says "
                                              r"214748364800 bytes, but its arrays .* at most"):
        ckpt.load_checkpoint(saved)


def test_a_fifo_as_a_rank_file_is_refused_without_blocking(saved):
    path = saved / "rank-00001.npz"
    path.unlink()
    os.mkfifo(path)
    resealed(saved, lambda m: m["files"][1].update(bytes=0))
    with pytest.raises(CheckpointError, match=r"rank-00001\.npz: a FIFO .*not a regular file"):
        ckpt.load_checkpoint(saved)


def test_a_manifest_nested_100000_deep_is_one_line(saved):
    (saved / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"manifest\.json: unreadable manifest \(JSON "
                                              r"nested deeper"):
        ckpt.load_checkpoint(saved)


def test_a_manifest_that_is_dev_zero_is_refused(saved):
    (saved / "manifest.json").unlink()
    (saved / "manifest.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"unreadable manifest \(a character device"):
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


# ------------------------------------------------------------------ saves that fail
def test_a_failed_save_over_an_old_checkpoint_keeps_it(tmp_path, monkeypatch):
    """A second run saving into the same directory (another --lr) that fails (a full
    disk) leaves the first run's checkpoint complete: the new one is written beside it
    and renamed into place only once complete; nothing of the failed save is left."""
    config = TrainConfig(dp=2, zero=1, precision="fp32", **SMALL)
    first = train(config, save_dir=tmp_path)
    (step_dir,) = list(tmp_path.iterdir())

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_rank_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        train(config.replace(lr=2e-3), save_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [step_dir.name]  # no debris
    state_dict = ckpt.consolidate(tmp_path)
    for name, value in first.state_dict.items():
        assert np.array_equal(state_dict[name], value), name


def test_the_issue_recipe_on_a_small_tmpfs(small_disk):
    """Two runs with different --lr into one --save on a 600 KiB tmpfs: the second fails
    for space, and `minipar consolidate` still takes the first run's checkpoint."""
    disk = small_disk("600k")
    flags = ["--seq-len", "8", "--n-layer", "2", "--d-model", "32", "--n-head", "2",
             "--micro-batch-size", "2", "--steps", "2", "--quiet", "--save", str(disk / "ck")]
    first = cli(["train", *flags])
    assert first.returncode == 0, first.stderr
    second = cli(["train", *flags, "--lr", "0.002"])
    assert second.returncode == 2 and "No space left" in second.stderr, second.stderr
    assert [p.name for p in (disk / "ck").iterdir()] == ["step-000002"]
    result = cli(["consolidate", str(disk / "ck"), str(disk.parent / "model.npz")])
    assert result.returncode == 0, result.stderr
    assert "step-000002 (run " in result.stdout and "; step 2)" in result.stdout


def cli(argv):
    return subprocess.run([sys.executable, "-m", "minipar.cli", *argv], capture_output=True,
                          text=True, timeout=300)


def test_an_interrupted_save_keeps_the_old_checkpoint_and_leaves_no_temporaries(
        tmp_path, monkeypatch):
    """Ctrl-C while a rank file is half written: the temporary file and the staging
    directory go, the checkpoint saved before stays."""
    config = TrainConfig(dp=2, zero=1, precision="fp32", **SMALL)
    train(config, save_dir=tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-000004").iterdir()}
    real_savez = np.savez

    def interrupted(f, **arrays):
        if dist.get_rank() == 1:
            f.write(b"half a file")
            raise KeyboardInterrupt
        real_savez(f, **arrays)

    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(config.replace(lr=2e-3), save_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000004"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-000004").iterdir()} == before
    assert ckpt.load_checkpoint(tmp_path).step == 4


KILLED_SAVE = """
import os, signal, sys
import numpy as np
from minipar.train import TrainConfig, train
real_savez = np.savez
def killed(f, **arrays):  # kill -9 half-way through a rank file
    f.write(b"half a file"); f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
np.savez = killed
train(TrainConfig(**{config!r}), save_dir={directory!r})
"""


def test_a_save_killed_half_way_loses_nothing_and_its_debris_goes_next_time(tmp_path):
    """kill -9 during the second run's save: the first run's checkpoint still loads, and
    the next save into the directory removes what the killed one left (its staging
    directory, whose lock died with it)."""
    settings = dict(dp=2, zero=1, precision="fp32", **SMALL)
    first = train(TrainConfig(**settings), save_dir=tmp_path)
    script = KILLED_SAVE.format(config={**settings, "lr": 2e-3}, directory=str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    state = ckpt.load_checkpoint(tmp_path)
    for name, value in first.state_dict.items():
        assert np.array_equal(state.tensors["param"][name], value), name
    train(TrainConfig(**settings).replace(steps=2), save_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000004"]


# ------------------------------------------------------------------ runs that share one
def test_the_files_of_another_run_are_refused(tmp_path):
    """Two runs saving into one directory at once could leave one run's rank file under
    the other's manifest, checksums and all (rank 0 hashes the files it finds): every
    file names its run, and loading compares it with the manifest's."""
    settings = dict(dp=2, zero=3, precision="fp32", **{**SMALL, "steps": 2})
    train(TrainConfig(**settings), save_dir=tmp_path / "a")
    train(TrainConfig(**settings, lr=2e-3), save_dir=tmp_path / "b")
    mine, theirs = (tmp_path / run / "step-000002" for run in "ab")
    (mine / "rank-00001.npz").write_bytes((theirs / "rank-00001.npz").read_bytes())
    manifest = json.loads((mine / "manifest.json").read_text())
    data = (mine / "rank-00001.npz").read_bytes()
    manifest["files"][1].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    manifest[schema.SEAL] = schema.seal(manifest)
    (mine / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"rank-00001\.npz: written by run '[0-9a-f]+'"
                                              r", but the manifest is run '[0-9a-f]+'.*two runs"):
        ckpt.load_checkpoint(mine)


def test_a_staging_directory_is_removed_only_once_its_writer_is_gone(tmp_path):
    """A save cleans the staging directories of saves that died, and only those: the
    lock of one being written (here held by this test, as another process would) keeps
    it. Without locks (Windows) only its own run's would be removed."""
    from minipar.files import DirectoryLock

    config = TrainConfig(precision="fp32", **{**SMALL, "steps": 1})
    alive, dead = tmp_path / ".step-000009.aaaa.partial", tmp_path / ".step-000009.bbbb.partial"
    for staging in (alive, dead):
        staging.mkdir(parents=True)
        (staging / "rank-00000.npz").write_bytes(b"half")
    writer = DirectoryLock(alive)
    if writer.acquire() is None:
        pytest.skip("no advisory locks on this system (fcntl.flock)")
    try:
        train(config, save_dir=tmp_path)
        assert alive.exists() and not dead.exists()
    finally:
        writer.release()
    train(config, save_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]


def test_a_swap_interrupted_between_its_renames_keeps_the_old_checkpoint(tmp_path):
    """The one moment a step directory is missing: its old checkpoint renamed aside, the
    new one not yet renamed into place. Readers take the old one; the next save puts it
    back."""
    config = TrainConfig(precision="fp32", **{**SMALL, "steps": 1})
    train(config, save_dir=tmp_path)
    old = tmp_path / ".step-000001.0123abcd.old"
    (tmp_path / "step-000001").rename(old)
    assert ckpt.load_checkpoint(tmp_path).step == 1
    train(config.replace(steps=2), save_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]


# ------------------------------------------------------------------ which checkpoint
def test_consolidate_refuses_a_directory_of_several_runs_and_says_which_it_takes(tmp_path):
    """`minipar consolidate DIR` took the highest step of any run in DIR without a word;
    now it takes the latest of one run's, says which, and refuses to guess between
    runs (naming them and the way out)."""
    settings = dict(precision="fp32", **{**SMALL, "steps": 2})
    train(TrainConfig(**settings), save_dir=tmp_path / "ck", save_every=1)
    train(TrainConfig(**{**settings, "lr": 2e-3, "steps": 3}), save_dir=tmp_path / "ck",
          save_every=3)
    refused = cli(["consolidate", str(tmp_path / "ck"), str(tmp_path / "m.npz")])
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "holds the checkpoints of 2 runs" in refused.stderr
    assert "step-000001, step-000002" in refused.stderr and "name the one" in refused.stderr
    assert not (tmp_path / "m.npz").exists()
    with pytest.raises(CheckpointError, match="2 runs"):
        train(TrainConfig(**{**settings, "steps": 5}), resume_from=tmp_path / "ck")
    chosen = cli(["consolidate", str(tmp_path / "ck" / "step-000003"), str(tmp_path / "m.npz")])
    assert chosen.returncode == 0, chosen.stderr
    assert "step-000003 (run " in chosen.stdout and "; step 3)" in chosen.stdout


def test_a_run_resumed_into_its_own_save_directory_is_one_trajectory(tmp_path):
    """Resuming into the directory one resumes from is no ambiguity: the resumed run
    records whose trajectory it continues, and consolidate says so."""
    settings = dict(precision="fp32", **{**SMALL, "steps": 2})
    train(TrainConfig(**settings), save_dir=tmp_path, save_every=1)
    train(TrainConfig(**{**settings, "steps": 3}), save_dir=tmp_path, resume_from=tmp_path)
    first = json.loads((tmp_path / "step-000001" / "manifest.json").read_text())
    last = json.loads((tmp_path / "step-000003" / "manifest.json").read_text())
    assert last["run"] != first["run"] and last["origin"] == first["origin"] == first["run"]
    result = cli(["consolidate", str(tmp_path), str(tmp_path / "m.npz")])
    assert result.returncode == 0, result.stderr
    assert f"(run {last['run']}, continuing run {first['run']}; step 3)" in result.stdout


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
