"""A checkpoint manifest edited by hand is refused before any array is read, with one
line naming the file and the field: its schema, its own checksum (seal), and its
agreement with its config and its files. Resume and consolidate go through the same
checks. (Each case edits a real checkpoint the way the issue's careless user or attacker
with a text editor would; `resealed` also fixes the seal, as a determined one would.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minipar.errors import CheckpointError
from minipar.train import TrainConfig, train
from minipar.train import checkpoint as ckpt
from minipar.train import manifest as schema

SMALL = dict(seq_len=8, n_layer=1, d_model=16, n_head=2, micro_batch_size=2, steps=2,
             grad_clip=0.05, precision="fp32")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    train(TrainConfig(dp=2, zero=1, **SMALL), save_dir=directory)
    return directory / "step-000002"


@pytest.fixture()
def checkpoint(saved, tmp_path):
    """A fresh copy of the saved checkpoint for each test to damage."""
    import shutil

    return shutil.copytree(saved, tmp_path / "step-000002")


def read(directory):
    return json.loads((directory / "manifest.json").read_text())


def write(directory, manifest, reseal: bool = True):
    if reseal and isinstance(manifest, dict):
        manifest[schema.SEAL] = schema.seal(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def entry(manifest, name, rank=0, kind="param"):
    return next(e for e in manifest["files"][rank]["entries"]
                if e["name"] == name and e["kind"] == kind)


def refused(directory, match):
    """Loading refuses it with this message; so does consolidate."""
    with pytest.raises(CheckpointError, match=match):
        ckpt.load_checkpoint(directory)
    with pytest.raises(CheckpointError, match=match):
        ckpt.consolidate(directory)


def test_the_saved_manifest_passes_its_own_checks(checkpoint):
    manifest = read(checkpoint)
    assert manifest["format"] == "minipar.checkpoint/3"
    assert manifest[schema.SEAL] == schema.seal(manifest)
    schema.check_manifest(manifest, "manifest.json")
    assert ckpt.load_checkpoint(checkpoint).step == 2


@pytest.mark.parametrize("field", ["step", "files", "config", "world_size", "format"])
def test_a_missing_field_is_named(checkpoint, field):
    manifest = read(checkpoint)
    del manifest[field]
    write(checkpoint, manifest)
    refused(checkpoint, rf"manifest\.json: (field '{field}' is missing|format None)")


def test_files_must_be_a_list_and_the_manifest_an_object(checkpoint):
    manifest = read(checkpoint)
    write(checkpoint, {**manifest, "files": {str(i): f for i, f in enumerate(manifest["files"])}})
    refused(checkpoint, r"manifest\.json\.files must be a list")
    write(checkpoint, [manifest])
    refused(checkpoint, r"manifest\.json: a manifest is a JSON object, got a list")


@pytest.mark.parametrize("step", ["abc", -1, 1.5, True, None])
def test_a_step_that_is_not_a_count_is_refused(checkpoint, step):
    manifest = read(checkpoint)
    manifest["step"] = step
    write(checkpoint, manifest)
    refused(checkpoint, r"manifest\.json(: step|\.step) must be an integer")


def test_any_edit_breaks_the_seal(checkpoint):
    manifest = read(checkpoint)
    manifest["step"] = 1  # well-formed, but another trajectory: refuse, do not resume
    write(checkpoint, manifest, reseal=False)
    refused(checkpoint, "manifest checksum mismatch")


def test_another_step_disagrees_with_the_files_even_when_resealed(checkpoint):
    manifest = read(checkpoint)
    manifest["step"] = 1
    write(checkpoint, manifest)
    refused(checkpoint, r"rank-00000\.npz: the file says step=2, the manifest says 1")


def test_another_world_size_is_refused(checkpoint):
    manifest = read(checkpoint)
    manifest["world_size"] = 3
    write(checkpoint, manifest)
    refused(checkpoint, r"world_size 3 and 2 file\(s\), but the config's mesh is .* = 2 ranks")


def test_a_transposed_weight_is_refused(checkpoint):
    manifest = read(checkpoint)
    for record in manifest["files"]:  # every rank's entries agree: only the config can tell
        for e in record["entries"]:
            if e["name"] == "h.0.mlp.c_fc.weight":
                e["shape"] = e["shape"][::-1]
    write(checkpoint, manifest)
    refused(checkpoint, r"h\.0\.mlp\.c_fc\.weight\): local shape \[64, 16\], but the "
                        r"config's model gives \[16, 64\]")


def test_a_shifted_shard_is_refused(checkpoint):
    manifest = read(checkpoint)
    shard = next(e for e in manifest["files"][1]["entries"] if e["start"] > 0)
    shard["start"] -= 1
    shard["stop"] -= 1
    write(checkpoint, manifest)
    refused(checkpoint, rf"{shard['kind']} of {shard['name']}.*element \d+ is held [02] "
                        r"time\(s\), expected 1")


def test_a_range_outside_the_tensor_is_refused(checkpoint):
    manifest = read(checkpoint)
    e = entry(manifest, "ln_f.bias")
    e["stop"] = 17
    write(checkpoint, manifest)
    refused(checkpoint, r"range \[0, 17\) is not a non-empty range of the 16 elements")


@pytest.mark.parametrize("placement, match", [
    ({"type": "Shard", "dim": 2}, r"placement\.dim 2 is not a dimension of shape"),
    ({"type": "Shard", "dim": -1}, r"placement\.dim must be an integer >= 0"),
    ({"type": "Shard"}, r"is not one of Replicate, Shard\(dim\)"),
    ({"type": "os.system", "dim": 0}, r"is not one of Replicate"),
])
def test_a_bogus_placement_is_refused(checkpoint, placement, match):
    manifest = read(checkpoint)
    entry(manifest, "h.0.mlp.c_fc.weight")["placement"] = placement
    write(checkpoint, manifest)
    refused(checkpoint, match)


def test_an_unknown_config_field_is_refused(checkpoint):
    manifest = read(checkpoint)
    manifest["config"]["learning_rate"] = 0.1
    write(checkpoint, manifest)
    refused(checkpoint, r"manifest\.json: config: --learning-rate: unknown setting")


def test_an_invalid_config_value_is_refused(checkpoint):
    manifest = read(checkpoint)
    manifest["config"]["n_head"] = 3
    write(checkpoint, manifest)
    refused(checkpoint, r"config: --n-head: d_model=16 is not divisible by n_head=3")


@pytest.mark.parametrize("junk", [
    {"bit_generator": "PCG64", "state": {"state": "abc", "inc": 1}, "has_uint32": 0,
     "uinteger": 0},
    {"bit_generator": "MT19937", "state": {}},
    {},
])
def test_junk_in_an_rng_state_is_refused(checkpoint, junk):
    manifest = read(checkpoint)
    manifest["files"][1]["rng_state"] = junk
    write(checkpoint, manifest)
    refused(checkpoint, r"files\[1\]\.rng_state is not a PCG64 generator state")


def test_another_dtype_is_refused(checkpoint):
    manifest = read(checkpoint)
    entry(manifest, "ln_f.bias")["dtype"] = "<f8"
    write(checkpoint, manifest)
    refused(checkpoint, r"ln_f\.bias\): dtype '<f8', but fp32 stores '<f4'")


def test_a_tensor_of_another_model_is_refused(checkpoint):
    manifest = read(checkpoint)
    entry(manifest, "ln_f.bias")["name"] = "h.7.ln_1.bias"
    write(checkpoint, manifest)
    refused(checkpoint, r"h\.7\.ln_1\.bias\): the fp32 model of the config has no such tensor")


def test_a_missing_kind_of_state_is_refused(checkpoint):
    manifest = read(checkpoint)
    for record in manifest["files"]:
        record["entries"] = [e for e in record["entries"] if e["kind"] != "exp_avg_sq"]
    write(checkpoint, manifest)
    refused(checkpoint, r"no file holds exp_avg_sq of")


def test_a_file_record_for_another_rank_is_refused(checkpoint):
    manifest = read(checkpoint)
    manifest["files"][1]["coords"]["dp"] = 0
    write(checkpoint, manifest)
    refused(checkpoint, r"files\[1\] is .*'dp': 0.*, expected .*'dp': 1")


def test_entries_the_file_does_not_hold_are_refused(checkpoint):
    """A manifest entry changed consistently with every check above still has to be what
    the rank file says about itself (written inside the file, covered by its sha256)."""
    manifest = read(checkpoint)
    a, b = manifest["files"][0]["entries"][:2]
    a["key"], b["key"] = b["key"], a["key"]
    write(checkpoint, manifest)
    refused(checkpoint, r"rank-00000\.npz: the file says entries=")


def test_resume_goes_through_the_same_checks(checkpoint):
    manifest = read(checkpoint)
    manifest["step"] = "abc"
    write(checkpoint, manifest)
    with pytest.raises(CheckpointError,
                       match=r"manifest\.json\.step must be an integer, got 'abc'"):
        train(TrainConfig(dp=2, zero=1, **{**SMALL, "steps": 3}), resume_from=checkpoint)


def test_cli_consolidate_of_a_bad_manifest_is_one_line_exit_2(checkpoint, tmp_path):
    manifest = read(checkpoint)
    entry(manifest, "h.0.mlp.c_fc.weight")["shape"] = [64, 16]
    write(checkpoint, manifest)
    out = tmp_path / "out.npz"
    result = subprocess.run([sys.executable, "-m", "minipar.cli", "consolidate",
                             str(checkpoint), str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "local shape [64, 16]" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("layout", [
    dict(dp=2, tp=2, pp=2, zero=1, precision="bf16-mixed", grad_accum_steps=2, n_layer=2),
    dict(dp=2, tp=2, zero=0, precision="fp64"),
    dict(dp=2, zero=3, precision="bf16-mixed"),
])
def test_checkpoints_of_every_layout_pass_the_checks(tmp_path, layout):
    """Tied embeddings on two stages, TP replicas, DP replicas, ZeRO shards: all valid."""
    config = {**SMALL, **layout, "steps": 1}
    train(TrainConfig(**config), save_dir=tmp_path)
    state = ckpt.load_checkpoint(tmp_path)
    assert state.step == 1 and set(state.tensors) >= {"param", "exp_avg", "exp_avg_sq"}
