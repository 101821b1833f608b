"""`minipar ... --engine torch` from the command line: on processes it starts, and as the
ranks of a job torchrun started on two "machines" (two node ranks on one loopback endpoint).

Needs PyTorch (pip install -e '.[torch]'); skipped with that message without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minipar.cli import main
from minipar.train import train

# Marked, not skipped at import: the file is still collected without torch, each test
# reported as skipped (tests/test_layout.py checks that no test file is lost).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="PyTorch is not installed: pip install -e '.[torch]'")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16",
        "--steps", "2", "--precision", "fp64", "--quiet"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def both_or_neither(nodes, timeout: float = 600) -> None:
    """Wait for both; one that fails stops the other at once (else its torchrun waits the
    exit barrier's 300 s for a node that is gone)."""
    deadline = time.monotonic() + timeout
    while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
        if any(node.poll() not in (None, 0) for node in nodes):
            break
        time.sleep(0.1)
    for node in nodes:
        if node.poll() is None:
            node.terminate()  # torchrun stops its workers on SIGTERM
    for node in nodes:
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


def test_two_node_ranks_of_torchrun_train_as_the_threads_do(tmp_path):
    """torchrun --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT -m minipar train ...,
    both "machines" on this one: rank 0's report is the thread engine's, bit for bit."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    logs = [(tmp_path / f"node{node}.out").open("w") for node in (0, 1)]
    with logs[0], logs[1]:
        nodes = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
             str(node), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "-m", "minipar",
             "train", "--engine", "torch", "--dp", "2", "--device", "uniform", *TINY,
             "--json", str(tmp_path / f"node{node}.json")],
            env=env, cwd=tmp_path, stdout=logs[node], stderr=subprocess.STDOUT)
            for node in (0, 1)]
        both_or_neither(nodes)
    outputs = [(tmp_path / f"node{node}.out").read_text() for node in (0, 1)]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(
        f"--- node {n}:\n{text[-3000:]}" for n, text in enumerate(outputs))
    assert not (tmp_path / "node1.json").exists()  # rank 0 reports; the others say nothing
    report = json.loads((tmp_path / "node0.json").read_text())
    assert report["engine"]["launcher"] == "torchrun" and report["world_size"] == 2
    threads = train(n_layer=2, d_model=32, n_head=4, seq_len=16, steps=2, precision="fp64",
                    dp=2)
    assert [s["loss"] for s in report["steps"]] == threads.losses
    assert [{k: v for k, v in r.items() if k != "measured"} for r in report["ranks"]] \
        == json.loads(threads.to_json())["ranks"]


def test_check_on_the_torch_engine_runs_the_cases_of_its_size(capsys):
    assert main(["check", "--engine", "torch", "--nproc-per-node", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "dp2: ok" in out and "pp2 zb-h1: ok" in out and "cp2 load-balanced: ok" in out
    assert "3 of 3 as expected" in out


def test_a_layout_the_processes_do_not_fit_is_one_line(capsys):
    assert main(["train", "--engine", "torch", "--nproc-per-node", "3", "--dp", "2",
                 *TINY]) == 2
    assert capsys.readouterr().err.strip() == (
        "minipar train: error: --nproc-per-node: 3 processes on this machine, but the "
        "layout has 2 ranks: use --nproc-per-node 2, or torchrun --nnodes N "
        "--nproc-per-node 2/N on N machines")
