"""Ctrl-C ends every command with one line, exit status 130, and nothing half-written:
no temporary file or staging directory is left, and an earlier output is whole.

Each case runs the CLI in a child process that sends itself SIGINT (what Ctrl-C sends) at
a chosen point: the n-th call of a function, patched to do so before it runs. The signal
reaches the main thread as a KeyboardInterrupt wherever the call was made (a rank thread
included), as a real Ctrl-C would; no case depends on how long anything takes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

SMALL = ["--seq-len", "8", "--d-model", "16", "--n-layer", "1", "--n-head", "2",
         "--micro-batch-size", "2"]
EARLIER = b"an earlier output, which must survive\n"

# The child: patch `where` (module:attribute.path) so that its n-th call sends SIGINT to
# this process (and then, with `linger`, sleeps that long: a rank stuck in a slow disk
# write when the user presses Ctrl-C), then run `minipar ARGV`.
CHILD = r"""
import functools, importlib, os, signal, sys, time
# SIGINT as a terminal's command gets it (a background job's shell may ignore it, and a
# child inherits that)
signal.signal(signal.SIGINT, signal.default_int_handler)
where, nth, linger = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
module, _, path = where.partition(":")
owner = importlib.import_module(module)
*parents, name = path.split(".")
for parent in parents:
    owner = getattr(owner, parent)
real, calls = getattr(owner, name), [0]

@functools.wraps(real)
def interrupted(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(linger)
    return real(*args, **kwargs)

setattr(owner, name, interrupted)
from minipar import cli
sys.exit(cli.main(sys.argv[4:]))
"""


def interrupt(where: str, nth: int, argv: list, linger: float = 0.0):
    result = subprocess.run([sys.executable, "-c", CHILD, where, str(nth), str(linger),
                             *map(str, argv)], capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert lines[-1] == f"minipar {argv[0]}: interrupted", result.stderr
    return result


# The child for a Ctrl-C while the command loads (before minipar.cli.main runs): a finder
# holds the first import of NumPy, says so and waits for the test's SIGINT, then the
# `minipar` command starts as the console script (`console`) or `python -m` (`module`)
# starts it. Nothing before the entry point's handler may import NumPy: if it did, the
# finder would hold it there and the signal would end in a traceback.
LOADING = r"""
import runpy, signal, sys, time

# SIGINT as a terminal's command gets it (a background job's shell may ignore it, and a
# child inherits that)
signal.signal(signal.SIGINT, signal.default_int_handler)

class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            print("loading numpy", flush=True)
            while True:
                time.sleep(0.01)
        return None

sys.meta_path.insert(0, Hold())
how, sys.argv = sys.argv[1], ["minipar", *sys.argv[2:]]
if how == "console":  # what pip's `minipar` script runs
    from minipar.console import main
    sys.exit(main())
runpy.run_module("minipar", run_name="__main__", alter_sys=True)  # python -m minipar
"""


@pytest.mark.parametrize("how", ["console", "module"])
@pytest.mark.parametrize("argv", [["plan", "--model", "gpt2"], ["train", "--steps", "1"]])
def test_ctrl_c_while_the_command_loads_is_one_line(how, argv):
    child = subprocess.Popen([sys.executable, "-c", LOADING, how, *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "loading numpy\n"
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130 and err == "minipar: interrupted\n", err


def test_the_console_script_is_the_entry_point_that_handles_ctrl_c():
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["minipar"] == "minipar.console:main"


def temporaries(*folders) -> list[str]:
    """What an interrupted write could leave: atomic_write's .tmp files, staging
    directories of checkpoints (.step-*.partial, .old)."""
    return sorted(str(p) for folder in folders for p in folder.rglob("*")
                  if p.name.endswith((".tmp", ".partial", ".old")))


def test_train_interrupted_between_steps():
    # (learning_rate runs in the rank threads: the signal still reaches the main thread)
    result = interrupt("minipar.train.loop:learning_rate", 3,
                       ["train", *SMALL, "--dp", "2", "--steps", "50", "--quiet"])
    assert result.stderr.strip() == "minipar train: interrupted"


@pytest.mark.parametrize("nth", [1, 2, 3, 5, 8])
def test_train_interrupted_while_saving_leaves_no_temporaries(tmp_path, nth):
    save = tmp_path / "save"
    interrupt("os:fsync", nth, ["train", *SMALL, "--dp", "2", "--zero", "1", "--steps", "3",
                                "--save", save, "--save-every", "1", "--quiet"])
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("dp, nth", [(1, 1), (2, 5)])  # rank 0's file; the manifest
def test_a_rank_stuck_in_a_slow_write_when_interrupted_leaves_no_temporaries(tmp_path, dp,
                                                                            nth):
    # rank 0 (which removes the staging directory of a failed save) is still writing when
    # the process ends: its own cleanup never runs, the CLI's does
    # (minipar.files.remove_temporaries)
    save = tmp_path / "save"
    interrupt("os:fsync", nth, ["train", *SMALL, "--dp", dp, "--steps", "2", "--save", save,
                                "--quiet"], linger=3.0)
    assert temporaries(tmp_path) == []


def test_train_interrupted_writing_its_report_keeps_the_earlier_one(tmp_path):
    (tmp_path / "r.json").write_bytes(EARLIER)
    interrupt("json:dumps", 1, ["train", *SMALL, "--steps", "1", "--quiet", "--json",
                                tmp_path / "r.json"])
    assert (tmp_path / "r.json").read_bytes() == EARLIER
    assert temporaries(tmp_path) == []


def test_plan_interrupted_while_searching():
    interrupt("minipar.plan.advisor:estimate", 5, ["plan", "--model", "llama2-7b",
                                                   "--gpus", "64"])


def test_plan_interrupted_writing_its_json_keeps_the_earlier_file(tmp_path):
    (tmp_path / "p.json").write_bytes(EARLIER)
    interrupt("os:fsync", 1, ["plan", "--model", "llama2-7b", "--dp", "8", "--json",
                              tmp_path / "p.json"])
    assert (tmp_path / "p.json").read_bytes() == EARLIER
    assert temporaries(tmp_path) == []


def test_check_interrupted():
    interrupt("minipar.train.loop:learning_rate", 5, ["check", "--quick"])


def test_timeline_interrupted_while_drawing(tmp_path):
    (tmp_path / "t.png").write_bytes(EARLIER)
    interrupt("minipar.viz.timeline:plot_timeline", 1,
              ["timeline", *SMALL, "--steps", "1", "--out", tmp_path / "t.png"])
    assert (tmp_path / "t.png").read_bytes() == EARLIER


def test_consolidate_interrupted_writing_keeps_the_earlier_file(tmp_path):
    from minipar import cli

    assert cli.main(["train", *SMALL, "--steps", "1", "--quiet", "--save",
                     str(tmp_path / "ck")]) == 0
    (tmp_path / "m.npz").write_bytes(EARLIER)
    interrupt("os:fsync", 1, ["consolidate", tmp_path / "ck", tmp_path / "m.npz"])
    assert (tmp_path / "m.npz").read_bytes() == EARLIER
    assert temporaries(tmp_path) == []


def test_profile_interrupted(tmp_path):
    from minipar import cli

    assert cli.main(["train", *SMALL, "--steps", "1", "--quiet", "--trace",
                     str(tmp_path / "trace")]) == 0
    interrupt("minipar.profile.cli:profile_traces", 1, ["profile", tmp_path / "trace"])


def test_demo_interrupted_says_so_on_a_line_of_its_own(tmp_path):
    result = interrupt("minipar.demo:train", 1, ["demo", "--out", tmp_path / "demo"])
    assert result.stderr.endswith("\nminipar demo: interrupted\n"), result.stderr
    assert temporaries(tmp_path) == []



def test_a_staging_directory_another_rank_writes_into_stays_listed(tmp_path, monkeypatch):
    """Rank 0's own cleanup of a failed save can race a rank still writing its file into
    the staging directory (rmtree then leaves it): the directory stays listed, and the
    CLI's cleanup at Ctrl-C removes it."""
    from minipar import files
    from minipar.train import checkpoint_dirs

    lock = files.DirectoryLock(tmp_path / "save")
    staging = checkpoint_dirs.begin(tmp_path / "save" / "step-000001", "0123abcd", lock)
    (staging / "rank-00001.npz").write_bytes(b"written by a rank that did not stop")
    monkeypatch.setattr(checkpoint_dirs, "remove", lambda path: None)  # rmtree lost the race
    checkpoint_dirs.discard(staging, lock)
    assert staging.exists()
    assert staging in files.remove_temporaries()
    assert temporaries(tmp_path) == []
