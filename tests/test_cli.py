"""The `minipar` command line, run as a user would run it (a subprocess)."""

import json
import subprocess
import sys

import pytest

from minipar.train import validate_report

SMALL = ["--seq-len", "16", "--d-model", "32", "--n-layer", "1", "--micro-batch-size", "2"]


def run(*args):
    return subprocess.run([sys.executable, "-m", "minipar.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_train_writes_a_valid_report_and_prints_tables(tmp_path):
    out = tmp_path / "out.json"
    result = run("train", "--steps", "5", "--json", str(out), *SMALL)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    validate_report(report)
    assert len(report["steps"]) == 5
    assert "loss" in result.stdout and "peak_total" in result.stdout


@pytest.mark.parametrize("args, flag", [
    (["--steps", "abc"], "--steps"),
    (["--steps", "0"], "--steps"),
    (["--precision", "fp16"], "--precision"),
    (["--n-head", "5"], "--n-head"),
    (["--global-batch-size", "7"], "--global-batch-size"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_flags_give_one_line_errors_naming_the_flag(args, flag):
    result = run("train", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert flag in lines[0] and "Traceback" not in result.stderr


def test_every_config_field_is_a_flag():
    import dataclasses

    from minipar.cli import build_parser
    from minipar.train import TrainConfig

    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in help_text
