"""Every output on a disk that is full when it is written (a small tmpfs, filled to its
last byte after the output path was checked): the work is kept (the report written
elsewhere or printed, the tables shown), an earlier file at that path is left whole, one
line says what could not be written, exit status 2, no traceback, no temporary file.

(The CLI runs in-process through `minipar.cli.main`, as in tests/test_outputs.py.)
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from minipar import cli
from minipar.errors import OutputError

SMALL = ["--seq-len", "8", "--d-model", "16", "--n-layer", "1", "--n-head", "2",
         "--micro-batch-size", "2", "--steps", "2"]
EARLIER = b'{"earlier": "a file the user had"}\n'


def fill(disk) -> None:
    """Fill `disk` to its last byte: a file that grows until the write fails."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    try:
        while True:  # the last few bytes
            os.write(fd, b"\0")
    except OSError:
        pass
    finally:
        os.close(fd)


def earlier(path) -> None:
    path.write_bytes(EARLIER)


def left_alone(disk, *paths) -> None:
    """The earlier files are whole and no temporary file is left beside them."""
    for path in paths:
        assert path.read_bytes() == EARLIER, path
    assert not [p for p in disk.rglob("*") if p.name.endswith(".tmp")]


def one_line(capsys, argv, match) -> tuple[str, str]:
    status = cli.main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert status == 2, captured.err
    assert "Traceback" not in captured.err
    assert err[-1].startswith(f"minipar {argv[0]}: error: {match}"), err
    assert "No space left on device" in err[-1]
    return captured.out, captured.err


def test_train_json_over_an_earlier_report_keeps_it_and_prints_the_new_one(
        small_disk, capsys):
    disk = small_disk("64k")
    earlier(disk / "r.json")
    fill(disk)
    out, _ = one_line(capsys, ["train", *SMALL, "--quiet", "--json", str(disk / "r.json")],
                      "--json: ")
    assert len(json.loads(out)["steps"]) == 2  # the run, on stdout
    left_alone(disk, disk / "r.json")


def test_train_trace_on_a_full_disk_keeps_the_run(small_disk, tmp_path, capsys):
    # the issue: a traceback after training, before the report was written
    disk = small_disk("64k")
    fill(disk)
    out, _ = one_line(capsys, ["train", *SMALL, "--dp", "2", "--trace", str(disk / "trace"),
                               "--json", str(tmp_path / "r.json")], "--trace: ")
    assert len(json.loads((tmp_path / "r.json").read_text())["steps"]) == 2
    assert "Peak memory per rank" in out and "report written to" in out
    assert "traces written" not in out
    left_alone(disk)


def test_train_profile_whose_traces_cannot_be_written_keeps_the_run(small_disk, capsys,
                                                                    monkeypatch):
    disk = small_disk("64k")
    fill(disk)
    monkeypatch.setattr(tempfile, "tempdir", str(disk))  # --profile alone traces there
    out, _ = one_line(capsys, ["train", *SMALL, "--profile"], "--profile: ")
    assert "Peak memory per rank" in out


def test_the_api_keeps_the_report_of_a_run_whose_traces_failed(small_disk):
    from minipar.train import TrainConfig, train

    disk = small_disk("64k")
    fill(disk)
    with pytest.raises(OutputError, match="^--trace: .*could not be written") as info:
        train(TrainConfig(seq_len=8, d_model=16, n_layer=1, n_head=2, micro_batch_size=2,
                          steps=2), trace=disk / "trace")
    assert len(info.value.report.steps) == 2 and info.value.outputs == ("trace",)


def test_plan_json_over_an_earlier_file(small_disk, capsys):
    disk = small_disk("64k")
    earlier(disk / "plan.json")
    fill(disk)
    out, _ = one_line(capsys, ["plan", "--model", "llama2-7b", "--dp", "8", "--json",
                               str(disk / "plan.json")], "--json: ")
    assert json.loads(out)["config"]["dp"] == 8  # the answer, on stdout
    left_alone(disk, disk / "plan.json")


def test_plan_export_over_earlier_files(small_disk, capsys):
    disk = small_disk("64k")
    (disk / "export").mkdir()
    names = ("ds_config.json", "megatron_args.txt", "megatron_deepspeed_args.txt",
             "launch.sh")
    for name in names:
        earlier(disk / "export" / name)
    fill(disk)
    one_line(capsys, ["plan", "--model", "llama2-7b", "--dp", "8", "--export",
                      str(disk / "export")], "--export: ")
    left_alone(disk, *(disk / "export" / name for name in names))


def test_consolidate_over_an_earlier_file(small_disk, tmp_path, capsys):
    assert cli.main(["train", *SMALL, "--quiet", "--save", str(tmp_path / "ck")]) == 0
    disk = small_disk("64k")
    earlier(disk / "model.npz")
    fill(disk)
    one_line(capsys, ["consolidate", str(tmp_path / "ck"), str(disk / "model.npz")],
             "OUT.npz: ")
    left_alone(disk, disk / "model.npz")


def test_timeline_over_an_earlier_figure(small_disk, capsys):
    disk = small_disk("64k")
    earlier(disk / "t.png")
    fill(disk)
    one_line(capsys, ["timeline", *SMALL, "--out", str(disk / "t.png")], "--out: ")
    left_alone(disk, disk / "t.png")


def test_the_demo_on_a_full_disk_shows_everything_then_says_what_is_missing(small_disk):
    from minipar.demo import DEMO_CONFIG, run_demo

    disk = small_disk("64k")
    (disk / "demo").mkdir()
    earlier(disk / "demo" / "memory.png")
    fill(disk)
    config = DEMO_CONFIG.replace(n_layer=2, d_model=16, n_head=2, seq_len=8, steps=1)
    lines = []
    with pytest.raises(OutputError, match="^--out: .*trace.*could not be written.*; .*the "
                                          "figures could not be written") as info:
        run_demo(disk / "demo", config=config, echo=lines.append,
                 progress=lambda *a, **k: None)
    assert info.value.report.report.equivalence["passed"]  # the run, checked
    assert any("Peak memory per rank" in line for line in lines)
    assert not any("figures written" in line or "trace written" in line for line in lines)
    left_alone(disk, disk / "demo" / "memory.png")
