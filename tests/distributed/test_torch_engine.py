"""The torch engine: the rank program on processes, booked as on threads, failing as clearly.

Needs PyTorch (pip install -e '.[torch]', torch==2.13.0); every test skips with that
message without it. The processes are started once per module (a 2-rank engine shared by
the tests that do not break it); the tests that break a launch start their own.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from minipar import distributed as dist
from minipar.distributed.engines import get_engine
from minipar.errors import ConfigError, DistError

# Marked, not skipped at import: the file is still collected without torch, each test
# reported as skipped (tests/test_layout.py checks that no test file is lost).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="PyTorch is not installed: pip install -e '.[torch]'")

BIG = 40_000  # elements: large enough that gloo's framing is under 1% of the bytes


@pytest.fixture(scope="module")
def engine():
    with get_engine("torch", nproc_per_node=2, timeout=60) as started:
        yield started


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raising KeyboardInterrupt in this process, as in a terminal's foreground
    job: a shell without job control starts a background job (`cmd &`) with SIGINT
    ignored, Python keeps it so, and these tests would read no Ctrl-C at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# ------------------------------------------------------------------ rank programs
def every_call(seed: int) -> dict:
    """Every collective and message once, from both ranks (results by name)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = np.random.default_rng(seed + rank).standard_normal((4, 6))
    big = np.random.default_rng(seed + rank).standard_normal(BIG)
    out = {"sum": dist.all_reduce(x), "avg": dist.all_reduce(x, op="avg"),
           "max": dist.all_reduce(x, op="max", category="buffers"),
           "bf16": dist.all_reduce(x.astype(ml_dtypes.bfloat16)),
           "int": dist.all_reduce(np.arange(5) * (rank + 1)),
           "gather dim 1": dist.all_gather(x, dim=1),
           "scatter dim 1": dist.reduce_scatter(np.tile(x, (1, n)), dim=1),
           "broadcast": dist.broadcast(x, src=n - 1), "reduce": dist.reduce(x, dst=0),
           "all_to_all": dist.all_to_all(np.tile(x, (n, 1))),
           "empty": dist.all_gather(np.zeros((0, 3))),
           "big sum": dist.all_reduce(big), "big gather": dist.all_gather(big),
           "big scatter": dist.reduce_scatter(big)}
    dist.barrier()
    work = dist.all_reduce(x * 2, async_op=True)
    gathered = dist.all_gather(x, async_op=True)
    dist.compute(1e12, "forward")  # the transfers run meanwhile, on both clocks
    out["async gather"], out["async sum"] = gathered.wait(), work.wait()
    with dist.phase("backward"):
        if rank == 0:
            first, second = dist.isend(x, 1, tag=3), dist.isend(x + 1, 1, tag=3)
            dist.send(big, 1)
            second.wait()
            first.wait()
        else:
            first, second = dist.irecv(0, tag=3), dist.irecv(0, tag=3)
            out["big message"] = dist.recv(0)
            out["second"], out["first"] = second.wait(), first.wait()  # out of order
    return out


def raises():
    dist.all_reduce(np.ones(3))
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.all_reduce(np.ones(3))


def mismatched():
    if dist.get_rank() == 0:
        dist.all_reduce(np.ones(3))
    else:
        dist.all_gather(np.ones(3))


def waits_for_a_returned_rank():
    if dist.get_rank() == 0:
        dist.all_reduce(np.ones(3))


def dies():
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def sleeps(folder: str):
    (open(f"{folder}/{dist.get_rank()}.pid", "w")).write(str(os.getpid()))
    time.sleep(60)


def sleeps_then_marks(folder: str):
    (open(f"{folder}/{dist.get_rank()}.pid", "w")).write(str(os.getpid()))
    time.sleep(20)
    (open(f"{folder}/{dist.get_rank()}.done", "w")).write("slept")


# ------------------------------------------------------------------ the same books
def test_every_call_returns_and_books_what_it_does_on_threads(engine):
    threads = get_engine("threads").launch(every_call, 2, 7)
    processes = engine.launch(every_call, 2, 7)
    for rank in range(2):
        ours, theirs = threads.results[rank], processes.results[rank]
        assert ours.keys() == theirs.keys()
        for name, value in ours.items():
            other = theirs[name]
            assert (value is None) == (other is None), name
            if value is not None:  # two ranks: gloo's ring adds a + b = b + a
                assert value.dtype == other.dtype and np.array_equal(value, other), name
        a, b = threads.devices[rank], processes.devices[rank]
        assert a.comm.records == b.comm.records  # bytes, peers, phases, simulated times
        assert a.clock.summary() == b.clock.summary() and a.clock.events == b.clock.events
        assert a.memory.summary() == b.memory.summary()


def test_the_sockets_carry_the_ring_bytes_and_gloos_own(engine):
    wire = engine.launch(every_call, 2, 7).measured[0]["wire_by_op"]
    # with big arrays in each, framing is small: the ring formula's bytes, within 5%
    for op in ("all_reduce", "all_gather", "send"):
        assert wire[op]["ledger_sent_bytes"] > 8 * BIG / 2
        assert 1.0 <= wire[op]["wire_sent_bytes"] / wire[op]["ledger_sent_bytes"] < 1.05, op
    # gloo's reduce-scatter is an all-reduce and a slice: twice the ring's bytes
    scatter = wire["reduce_scatter"]
    assert 1.9 < scatter["wire_sent_bytes"] / scatter["ledger_sent_bytes"] < 2.1
    assert "PyTorch #118911" in scatter["algorithm"]
    assert wire["clock exchange (minipar)"]["ledger_sent_bytes"] is None


# ------------------------------------------------------------------ training
SMALL = dict(n_layer=2, d_model=32, n_head=4, seq_len=16, steps=2, precision="fp64",
             micro_batch_size=2)


@pytest.mark.parametrize("layout", [dict(dp=2, zero=1, grad_accum_steps=2),
                                    dict(pp=2, schedule="zb-h1", grad_accum_steps=4)])
def test_two_ranks_train_bit_identically_and_report_what_was_measured(engine, layout):
    from minipar.train import train
    from minipar.train.config import TrainConfig
    from minipar.train.crosscheck import compare
    from minipar.train.schema import validate_report

    config = TrainConfig(**SMALL, **layout)
    steps = []
    report = train(config.replace(check=True), engine=engine,
                   progress=lambda step, record: steps.append((step, record["loss"])))
    result = compare("", train(config), report)
    assert result.ledgers_equal, result.differing
    assert result.identical and result.max_rel_diff == 0.0
    assert report.equivalence["passed"]
    assert steps == [(s["step"], s["loss"]) for s in report.steps]  # relayed from ranks
    data = report.to_dict()
    validate_report(data)
    assert data["engine"]["name"] == "torch" and data["engine"]["backend"] == "gloo"
    assert len(data["engine"]["hosts"]) == 2
    for rank in data["ranks"]:
        measured = rank["measured"]
        assert len(measured["wall_step_s"]) == 2 and min(measured["wall_step_s"]) > 0
        assert 0 < measured["wall_comm_s"] < sum(measured["wall_step_s"]) + 1
        assert measured["wire_sent_bytes"] == sum(
            v["wire_sent_bytes"] for v in measured["wire_by_op"].values())


@pytest.mark.filterwarnings("ignore:::hta")
def test_traces_on_the_wall_clock_beside_the_simulated_ones(engine, tmp_path):
    from minipar.profile.breakdown import profile_traces
    from minipar.train import train
    from minipar.viz.measured import plot_simulated_and_measured

    layout = dict(**SMALL, dp=2, grad_accum_steps=2)
    train(**layout, engine=engine, trace=tmp_path / "torch")
    train(**layout, trace=tmp_path / "threads")
    for name in ("rank0.json", "rank1.json"):  # the simulated clock: the same file
        assert ((tmp_path / "torch" / "simulated" / name).read_bytes()
                == (tmp_path / "threads" / name).read_bytes())
    measured = dist.read_traces(tmp_path / "torch")
    assert measured[0]["minipar"]["clock"] == "wall"
    assert measured[0]["distributedInfo"]["backend"] == "gloo"
    assert profile_traces(measured).ranks  # minipar profile reads it as any trace
    if importlib.util.find_spec("hta") is not None:  # and so does HTA (the profile extra)
        from hta.common.trace import Trace
        from hta.trace_analysis import TraceAnalysis

        load = Trace.load_traces  # in this process (tests/profile/test_profile_hta.py)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HTA_DISABLE_NS_ROUNDING", "1")
            env.setattr(Trace, "load_traces", lambda self, *args, **kwargs: load(
                self, *args, **{**kwargs, "use_multiprocessing": False}))
            breakdown = TraceAnalysis(trace_dir=str(tmp_path / "torch")) \
                .get_temporal_breakdown(visualize=False)
        assert list(breakdown["rank"]) == [0, 1]
    figure = plot_simulated_and_measured(tmp_path / "torch")
    assert [ax.get_title() for ax in figure.axes][:2] == [
        "simulated clock (the ledgers' GPUs)", "measured: torch.distributed processes, gloo"]


def test_three_ranks_sum_in_another_order_within_the_tolerance():
    from minipar.train.crosscheck import TOLERANCE, cross_check
    from minipar.train.grid import GRID

    case = next(c for c in GRID if c.name == "dp3 zero3 (padded shards)")
    with get_engine("torch", nproc_per_node=3, timeout=60) as engine:
        result = cross_check(case.config(steps=2), engine, case.name)
    assert result.ledgers_equal, result.differing
    assert result.max_rel_diff <= TOLERANCE and result.equivalence["passed"]


# ------------------------------------------------------------------ failures
def test_a_rank_that_raises_is_the_error_with_its_rank():
    with get_engine("torch", timeout=20) as engine, pytest.raises(ValueError) as caught:
        engine.launch(raises, 2)
    assert str(caught.value) == "rank 1 cannot go on" and caught.value.rank == 1
    assert "raised on rank 1 of 2" in caught.value.__notes__[0]
    assert "in raises" in str(caught.value.__cause__)  # the rank's own traceback


def test_different_collectives_are_named_rank_by_rank():
    with get_engine("torch", timeout=20) as engine, \
            pytest.raises(dist.CollectiveMismatchError) as caught:
        engine.launch(mismatched, 2)
    assert "rank 0: all_reduce(shape=(3,)" in str(caught.value)
    assert "rank 1: all_gather(shape=(3,)" in str(caught.value)


def test_a_wait_for_a_returned_rank_ends_at_the_timeout_naming_the_call():
    with get_engine("torch", timeout=2) as engine, \
            pytest.raises(dist.LaunchTimeoutError) as caught:
        engine.launch(waits_for_a_returned_rank, 2)
    message = str(caught.value)
    assert message.startswith("launch timed out: rank 0 waited more than 2 s in all_reduce(")
    assert message.endswith("rank 1: has returned")


def test_a_rank_process_that_dies_stops_the_launch():
    with get_engine("torch", timeout=20) as engine, pytest.raises(DistError) as caught:
        engine.launch(dies, 2)
    assert "rank 1's process" in str(caught.value) and "signal 9" in str(caught.value)


def test_ctrl_c_stops_every_rank_process(engine, tmp_path, ctrl_c_raises):
    started = engine.launch(every_call, 2, 0)  # (processes up)
    assert started.results
    pids = [p.pid for p in engine._pool.processes]
    os.kill(pids[1], signal.SIGINT)  # a terminal's Ctrl-C reaches them too: ignored
    time.sleep(0.2)
    assert engine._pool.processes[1].is_alive()

    def interrupt():
        while len(list(tmp_path.glob("*.pid"))) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        engine.launch(sleeps, 2, str(tmp_path))
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert engine.launch(every_call, 2, 0).results  # a new set of processes


def test_ctrl_c_taken_by_another_thread_stops_the_ranks_at_once(engine, tmp_path,
                                                                 ctrl_c_raises):
    """The kernel may hand a process's SIGINT to any thread that does not block it (the
    host's TCPStore and gloo threads, or this test's): Python then only sets its flag,
    and the host's wait for its ranks must look at it before they finish."""
    engine.launch(every_call, 2, 0)  # (processes up)

    def interrupt():
        while len(list(tmp_path.glob("*.pid"))) < 2:
            time.sleep(0.05)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # this thread's

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        engine.launch(sleeps_then_marks, 2, str(tmp_path))
    assert not list(tmp_path.glob("*.done"))  # stopped, not slept out


# A rank of a job started elsewhere (torchrun's environment), which counts gloo's threads
# after the launch and at exit, after the engine has left the job (atexit runs last in,
# first out: this handler is registered before the engine's).
JOINED_RANK = """
import atexit, os, sys
import numpy as np
from minipar import distributed as dist
from minipar.distributed.engines import get_engine

def gloo_threads():
    names = [open(f"/proc/self/task/{task}/comm").read() for task in os.listdir("/proc/self/task")]
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)

atexit.register(lambda: print("at exit", gloo_threads(), flush=True))
get_engine("torch", timeout=60).launch(lambda: dist.all_reduce(np.ones(4), async_op=True).wait(), 2)
print("after the launch", gloo_threads(), flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_rank_of_a_torchrun_job_leaves_with_gloos_threads_joined():
    """Gloo's worker threads end before the interpreter does: one still running when it
    finalizes can abort the process at exit (torch_engine.Joined._leave)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = str(Path(__file__).resolve().parents[2])
    ranks = [subprocess.Popen(
        [sys.executable, "-c", JOINED_RANK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "PYTHONPATH": os.pathsep.join([root, *sys.path])})
        for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    for output in outputs:
        counts = dict(line.rsplit(" ", 1) for line in output.splitlines()
                      if line.startswith(("after", "at exit")))
        assert int(counts["after the launch"]) > 0 and counts["at exit"] == "0", output


def test_layouts_and_rendezvous_that_cannot_work_are_one_line(monkeypatch):
    import socket
    import sys

    from minipar.distributed.torch_world import join

    with get_engine("torch", nproc_per_node=3) as engine, pytest.raises(ConfigError) as caught:
        engine.launch(raises, 2)
    assert str(caught.value).startswith("--nproc-per-node: 3 processes on this machine, "
                                        "but the layout has 2 ranks")
    with pytest.raises(ConfigError, match="--nproc-per-node: starts processes of the torch"):
        get_engine("threads", nproc_per_node=2)
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "torch", None)
        with pytest.raises(ConfigError, match=r"pip install 'minipar\[torch\]'"):
            get_engine("torch")
    with pytest.raises(DistError, match="could not join the job at the rendezvous "
                                        "127.0.0.1:9 within 1 s"):
        join(1, 2, "127.0.0.1", 9, 1.0)  # nobody listens on port 9 (discard)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(DistError, match=f"the rendezvous port 127.0.0.1:{port} is in use"):
            join(0, 2, "127.0.0.1", port, 1.0, from_environment=True)
