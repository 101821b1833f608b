"""Outputs are checked before the work starts, and a write that fails after it keeps the
work: the CLI prints the report and says in one line (exit 2) what it could not write.

(The tests run the CLI in-process through `minipar.cli.main`, so that they can break the
disk with monkeypatch; the exit status and the one line on stderr are what a user sees.)
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from minipar import cli
from minipar.errors import OutputError
from minipar.train import TrainConfig, train
from minipar.train.outputs import check_output_dir, check_output_file

SMALL = ["--seq-len", "8", "--d-model", "16", "--n-layer", "1", "--n-head", "2",
         "--micro-batch-size", "2", "--steps", "2"]
UNWRITABLE = "/proc/minipar-test"  # exists nowhere and cannot be created, even by root


@pytest.fixture()
def no_training(monkeypatch):
    """A refusal must come before any training: make training itself fail loudly."""
    import importlib

    loop = importlib.import_module("minipar.train.loop")

    def must_not_run(*args, **kwargs):
        raise AssertionError("training started before the output path was checked")

    monkeypatch.setattr(loop, "_launch", must_not_run)


def one_line_exit_2(capsys, argv, match):
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err
    return err


@pytest.mark.parametrize("path, match", [
    ("{tmp}/missing/out.json", "missing does not exist"),
    ("{tmp}", "is a directory"),
    ("", "--json: empty path"),
    (UNWRITABLE + "/out.json", "does not exist"),
    ("/proc/out.json", "cannot write into /proc"),
])
def test_train_json_is_checked_before_training(tmp_path, capsys, no_training, path, match):
    path = path.format(tmp=tmp_path)
    one_line_exit_2(capsys, ["train", *SMALL, "--quiet", "--json", path], match)


@pytest.mark.parametrize("path, match", [
    ("{tmp}/a-file", "is a file, not a directory"),
    ("{tmp}/a-file/below", "a-file is a file, not a directory"),
    ("", "--save: empty path (it would write into the current directory)"),
    (UNWRITABLE + "/ckpt", "cannot write into /proc"),
])
def test_train_save_is_checked_before_training(tmp_path, capsys, no_training, path, match):
    (tmp_path / "a-file").write_text("not a directory")
    path = path.format(tmp=tmp_path)
    one_line_exit_2(capsys, ["train", *SMALL, "--quiet", "--save", path], match)


def test_the_api_checks_save_dir_before_training(tmp_path, no_training):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OutputError, match="--save-dir: .*a-file is a file"):
        train(TrainConfig(steps=1), save_dir=tmp_path / "a-file")


def test_consolidate_timeline_and_demo_check_their_outputs_first(tmp_path, capsys):
    one_line_exit_2(capsys, ["consolidate", str(tmp_path), str(tmp_path / "no" / "o.npz")],
                    "OUT.npz: ")
    one_line_exit_2(capsys, ["timeline", *SMALL, "--out", str(tmp_path)], "is a directory")
    (tmp_path / "f").write_text("")
    one_line_exit_2(capsys, ["demo", "--out", str(tmp_path / "f")], "is a file")


def test_a_report_that_cannot_be_written_at_the_end_is_printed(tmp_path, capsys,
                                                              monkeypatch):
    from minipar.train.report import Report

    def disk_full(self, path=None, indent=2):
        if path is not None:
            raise OSError(28, "No space left on device")
        return json.dumps(self.to_dict(), indent=indent)

    monkeypatch.setattr(Report, "to_json", disk_full)
    out = tmp_path / "report.json"
    status = cli.main(["train", *SMALL, "--quiet", "--json", str(out)])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.count("\n") == 1
    assert "--json: " in captured.err and "No space left on device" in captured.err
    report = json.loads(captured.out)  # the work is not lost: the report is on stdout
    assert len(report["steps"]) == 2 and not out.exists()


def test_a_checkpoint_that_cannot_be_written_keeps_the_run(tmp_path, capsys, monkeypatch):
    import importlib

    ckpt = importlib.import_module("minipar.train.checkpoint")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_rank_file", disk_full)
    with pytest.raises(OutputError, match="could not be written") as info:
        train(TrainConfig(seq_len=8, d_model=16, n_layer=1, n_head=2, micro_batch_size=2,
                          steps=2, dp=2), save_dir=tmp_path)
    assert len(info.value.report.steps) == 2  # the finished run, with every step
    assert not list(tmp_path.glob("*/manifest.json"))  # no manifest vouches for a failed save
    status = cli.main(["train", *SMALL, "--save", str(tmp_path)])
    captured = capsys.readouterr()
    assert status == 2 and "peak_total" in captured.out  # the tables are printed
    assert captured.err.strip().splitlines()[-1].startswith("minipar train: error: --save: ")
    assert "checkpoints written" not in captured.out


def test_check_output_helpers_accept_what_can_be_written(tmp_path):
    assert check_output_file("json", tmp_path / "r.json") == tmp_path / "r.json"
    assert check_output_dir("save", tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checking creates nothing
    assert [p.name for p in tmp_path.iterdir()] == []  # and leaves no probe behind
    np.save(tmp_path / "x.npy", np.zeros(1))
    check_output_file("output", tmp_path / "x.npy")  # overwriting a file is fine


def test_consolidate_names_its_positional_output_not_a_flag_that_does_not_exist(tmp_path,
                                                                                capsys):
    code = cli.main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "no" / "o.npz")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "OUT.npz" in err[0] and "--output" not in err[0]


def test_an_output_inside_a_checkpoint_or_named_like_a_directory_is_refused(tmp_path, capsys):
    """`consolidate CKPT CKPT/manifest.json` wrote the state dict over the manifest, and
    `--json CKPT/r.json` wrote into the checkpoint; `OUT.npz/` wrote OUT.npz and said
    OUT.npz/ (a fuzzer's findings)."""
    assert cli.main(["train", *SMALL, "--quiet", "--dp", "2", "--zero", "1",
                     "--save", str(tmp_path / "ck")]) == 0
    step = next((tmp_path / "ck").glob("step-*"))
    manifest = (step / "manifest.json").read_bytes()
    one_line_exit_2(capsys, ["consolidate", str(step), str(step / "manifest.json")],
                    "is a minipar checkpoint")
    one_line_exit_2(capsys, ["train", *SMALL, "--quiet", "--json", str(step / "r.json")],
                    "is a minipar checkpoint")
    assert (step / "manifest.json").read_bytes() == manifest
    assert not (step / "r.json").exists()
    one_line_exit_2(capsys, ["consolidate", str(step), f"{tmp_path}/o.npz/"],
                    "ends with a slash")
    assert not (tmp_path / "o.npz").exists()


def test_a_timeline_without_an_extension_says_the_png_it_writes(tmp_path, capsys):
    assert cli.main(["timeline", *SMALL, "--steps", "1", "--out", str(tmp_path / "chart")]) == 0
    assert f"{tmp_path / 'chart.png'}: timeline" in capsys.readouterr().out
    assert (tmp_path / "chart.png").exists()
    one_line_exit_2(capsys, ["timeline", *SMALL, "--all-steps", "--step", "0", "--out",
                             str(tmp_path / "t.png")], "--all-steps draws every step")


def test_a_directory_with_some_other_manifest_json_is_not_a_checkpoint(tmp_path, capsys):
    """The checkpoint guard reads the manifest's format: a web app's manifest.json
    beside the output is no reason to refuse it (a reviewer's case)."""
    (tmp_path / "manifest.json").write_text('{"name": "my site"}')
    assert cli.main(["train", *SMALL, "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.json").exists()


def test_a_fifo_named_manifest_json_beside_an_output_does_not_block(tmp_path):
    """The checkpoint guard peeks at a manifest.json beside the output: a FIFO of that
    name blocked the open forever; it is no checkpoint, and the output is fine."""
    os.mkfifo(tmp_path / "manifest.json")
    assert check_output_file("json", tmp_path / "r.json") == tmp_path / "r.json"
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "manifest.json").symlink_to("/dev/zero")  # read until memory ran out
    assert check_output_file("json", tmp_path / "r.json") == tmp_path / "r.json"
