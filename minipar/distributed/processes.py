"""The rank processes of the torch engine (torch_engine.py): what each one runs, and the
pool of them this machine starts.

    pool = Pool(4, timeout)                 # 4 processes, joined at a store on 127.0.0.1
    outcomes = pool.run({"fn": fn, ...})    # fn on each, as rank 0..3: (result, device,
    pool.close()                            #   measured) per rank

The processes come from multiprocessing's forkserver: torch is imported once, in the
server, and each rank is a fork of it. They meet at a rendezvous store (torch's
TCPStore) that the launching process holds on a free port of 127.0.0.1, and stay up
from run to run (one start-up for `minipar check`'s many runs) until close() or a
failure. Each rank runs fn in a rank context as a thread of launch.py does (`run_rank`,
also what a torchrun process runs), with a MeasuredDevice (measured.py) and a
TorchCluster (torch_cluster.py), one BLAS thread per process as one per thread there.

Failures end in one error, within the launch timeout (launch.py's, used as gloo's):
  - a rank that raises: the others are stopped (SIGTERM, then SIGKILL) and the run
    raises that rank's exception with `.rank`, a note, and its traceback as the cause;
  - a wait that times out (a peer that never calls, ranks on different groups) or a peer
    that is gone: LaunchTimeoutError / DistError naming the call, then every other
    rank's flight-recorder line (what it waits in, its last call), which a small thread
    of each rank process answers, or "has returned";
  - a rank process that dies without a word (killed, out of memory): its exit status;
  - Ctrl-C: the rank processes ignore SIGINT; the launching process stops them.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for

from threadpoolctl import threadpool_limits

from minipar.autograd.tracking import use_device

from .allocator import keep_freed_memory
from .clock import DeviceProfile
from .context import _rank_context
from .errors import DistError, LaunchTimeoutError, PeerLostError
from .measured import MeasuredDevice
from .p2p import finish_pending

GRACE = 2.0  # seconds a stopped rank, or a status reply, gets
# The host waits for its ranks in slices this long: a Ctrl-C that the kernel hands to
# one of the host's other threads (TCPStore's, gloo's) sets Python's flag without
# interrupting the main thread's wait, which would otherwise see it only when a rank
# next speaks.
SIGNAL_CHECK = 0.25
# What gloo runs for each call (facebookincubator/gloo, gloo/*.cc; torch's ProcessGroupGloo).
GLOO_ALGORITHMS = {
    "all_reduce": "ring: reduce-scatter then all-gather, in segments (gloo/allreduce.cc)",
    "all_gather": "ring, each piece in two halves (gloo/allgather.cc)",
    "reduce_scatter": "an all-reduce (ring), then each rank keeps its slice (PyTorch #118911)",
    "broadcast": "binomial tree from the root (gloo/broadcast.cc)",
    "reduce": "ring reduce-scatter, then every chunk sent to the root (gloo/reduce.cc)",
    "all_to_all": "n-1 pairwise sends, one per peer (gloo/alltoall.cc)",
    "barrier": "dissemination barrier: log2(n) rounds of empty messages (gloo/barrier.cc)",
    "send": "one message on the pair's connection of the world group",
    "clock exchange (minipar)": "not the rank program's: a 24-byte stamp per member and "
                                "collective, a header and a reply per message",
}
_TO_HOST = None  # in a rank process started here: its connection to the launching process


# ------------------------------------------------------------------ one rank, in its process
def run_rank(world, job: dict, state: dict | None = None):
    """Run job["fn"] as this process's rank: (its result, its Device, what was measured)."""
    import torch.distributed as tdist

    from .torch_cluster import TorchCluster

    profile = job["device"] if job["device"] is not None else DeviceProfile()
    gpus_per_node = job["gpus_per_node"]
    keep_freed_memory()  # as launch.py's ranks (allocator.py)
    tdist.barrier()  # a common start: every rank's epoch is this moment, within the skew
    cluster = TorchCluster(world, gpus_per_node, profile, job["timeout"])
    device = cluster.device = MeasuredDevice(world.rank, world.world_size, gpus_per_node,
                                             profile, cluster=cluster,
                                             epoch=time.perf_counter())
    if state is not None:
        state["cluster"] = cluster
    if job["trace"]:
        device.start_trace()
    world.meter.reset()
    token = _rank_context.set((cluster, device))
    try:
        with use_device(device), threadpool_limits(limits=1, user_api="blas"):
            result = job["fn"](*job["args"], **job["kwargs"])
            finish_pending(device)
    finally:
        _rank_context.reset(token)
    world.meter.flush()
    return result, device, measurements(cluster, device, world.meter)


def measurements(cluster, device, meter) -> dict:
    """A rank's `measured` section (the training loop adds wall_step_s)."""
    ledger = device.comm.sent_by_op
    wire = {}
    if meter.enabled:
        for label in sorted(set(meter.by_label) | set(ledger)):
            wire[label] = {"algorithm": GLOO_ALGORITHMS.get(label),
                           "wire_sent_bytes": meter.by_label.get(label, 0),
                           "ledger_sent_bytes": ledger.get(label)}
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "wall_comm_s": cluster.wall_comm_s,
            "wire_sent_bytes": meter.sent_bytes if meter.enabled else None,
            "wire_by_op": wire}


def portable(error: BaseException) -> tuple:
    """(pickled error or None, one line, its traceback): what crosses to the host."""
    text = "".join(traceback.format_exception(error))
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - an error that does not pickle is sent as text
        data = None
    return data, f"{type(error).__name__}: {error}", text


class RankTraceback(Exception):  # noqa: N818 (the cause of a rank's error, as text)
    """The traceback of an error raised in a rank process (shown as the error's cause)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n" + self.args[0]


def rebuild(rank: int, world_size: int, data, summary: str, text: str) -> BaseException:
    """A rank's error, raised again here with its rank (as launch.py does for threads)."""
    error = pickle.loads(data) if data is not None else DistError(f"rank {rank}: {summary}")
    if not isinstance(error, DistError):
        error.rank = rank
        error.add_note(f"(raised on rank {rank} of {world_size} in minipar's torch engine)")
        error.__cause__ = RankTraceback(text)
    return error


class Relay:
    """Stands for an object of the launching process in a rank process: `relay.m(*args)`
    there runs `target.m(*args)` here (engine.relay: the training loop's progress)."""

    def __init__(self, key: int) -> None:
        self.key = key

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args):
            _TO_HOST.send(("call", self.key, method, args))
        return call


def serve(rank: int, world_size: int, port: int, timeout: float, connection, status) -> None:
    """A rank process started here: join, then run each job the host sends, until told to
    stop or a job fails."""
    global _TO_HOST
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # stopped: no traceback
    _TO_HOST = connection
    try:
        from .torch_world import join

        world = join(rank, world_size, "127.0.0.1", port, timeout)
        connection.send(("ready", rank, socket.gethostname()))
    except BaseException as error:  # noqa: BLE001 - said to the host, which raises it
        connection.send(("error", rank, *portable(error)))
        return
    state: dict = {"cluster": None}
    threading.Thread(target=_answer_status, args=(status, state), daemon=True).start()
    while True:
        try:
            job = connection.recv_bytes()
        except (EOFError, OSError):
            return
        if job == b"stop":
            break
        try:
            outcome = run_rank(world, pickle.loads(job), state)
        except BaseException as error:  # noqa: BLE001 - said to the host, which raises it
            connection.send(("error", rank, *portable(error)))
            return  # the processes are out of step now: the host stops them all
        connection.send(("result", rank, outcome))
    import torch.distributed as tdist

    tdist.destroy_process_group()


def _answer_status(status, state: dict) -> None:
    """The flight recorder: answer the host's "status?" with this rank's line."""
    while True:
        try:
            status.recv()
        except (EOFError, OSError):
            return
        cluster = state["cluster"]
        status.send(cluster.status() if cluster is not None else "not started")


# ------------------------------------------------------------------ the host's side
class Pool:
    """world_size rank processes on this machine, started once (the module docstring)."""

    def __init__(self, world_size: int, timeout: float, relays: dict) -> None:
        import torch.distributed as tdist

        began = time.perf_counter()
        self.world_size, self.timeout = world_size, timeout
        self.relays = relays  # the targets of Relay calls from the ranks
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "torch.distributed",
                                        "minipar.distributed.torch_cluster"])
        self.store = tdist.TCPStore("127.0.0.1", 0, None, True,
                                    datetime.timedelta(seconds=timeout),
                                    wait_for_workers=False)
        self.processes, self.connections, self.status = [], [], []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            status_ours, status_theirs = context.Pipe()
            process = context.Process(target=serve, name=f"minipar-rank-{rank}", daemon=True,
                                      args=(rank, world_size, self.store.port, timeout,
                                            theirs, status_theirs))
            process.start()
            theirs.close()
            status_theirs.close()
            self.processes.append(process)
            self.connections.append(ours)
            self.status.append(status_ours)
        try:
            self.hosts = self._collect("ready")
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - began

    def run(self, job: dict) -> list:
        """Send the job to every rank; their outcomes in rank order."""
        data = pickle.dumps(job)
        for connection in self.connections:
            connection.send_bytes(data)
        return self._collect("result")

    def _collect(self, kind: str) -> list:
        outcomes, pending = [None] * self.world_size, set(range(self.world_size))
        while pending:
            waiting = {self.connections[r]: r for r in pending}
            waiting.update({self.processes[r].sentinel: r for r in pending})
            for ready in wait_for(list(waiting), SIGNAL_CHECK):
                rank = waiting[ready]
                if rank not in pending:
                    continue
                try:
                    message = self.connections[rank].recv()
                except (EOFError, OSError):
                    raise self._failure(rank, None, pending) from None
                if message[0] == "call":
                    _, key, method, args = message
                    getattr(self.relays[key], method)(*args)
                elif message[0] == kind:
                    outcomes[rank] = message[2]
                    pending.discard(rank)
                else:
                    raise self._failure(rank, message, pending)
        return outcomes

    def _failure(self, rank: int, message, running: set) -> BaseException:
        """The error to raise for a failed launch: the rank's own, or its death; for a
        wait that timed out or lost its peer, first a root cause from another rank (a
        moment to report it), and every rank's flight-recorder line."""
        if message is None:
            process = self.processes[rank]
            process.join(GRACE)
            code = process.exitcode
            how = (f"was killed by signal {-code}" if code is not None and code < 0
                   else f"exited with status {code}")
            return DistError(f"rank {rank}'s process (pid {process.pid}) {how} before it "
                             "finished: the launch was stopped")
        error = rebuild(rank, self.world_size, *message[2:])
        if not isinstance(error, LaunchTimeoutError | PeerLostError):
            return error
        # A wait that ended in gloo's error: another rank may have the cause.
        others = [r for r in range(self.world_size) if r != rank]
        listening = [self.connections[r] for r in others if r in running]
        said: dict[int, str] = {}  # what the other ranks' own waits ended in
        deadline = time.monotonic() + GRACE
        while listening and deadline > time.monotonic():
            for ready in wait_for(listening, deadline - time.monotonic()):
                listening.remove(ready)
                r = self.connections.index(ready)
                try:
                    other = ready.recv()
                except (EOFError, OSError):  # that rank's process is gone: the cause
                    return self._failure(r, None, running)
                if other[0] == "result":
                    running.discard(r)
                elif other[0] == "error":
                    cause = rebuild(r, self.world_size, *other[2:])
                    if not isinstance(cause, LaunchTimeoutError | PeerLostError):
                        return cause  # a rank's own error: the others only lost it
                    said[r] = str(cause)
        lines = [said.get(r) or f"rank {r}: " + (self._status(r) if r in running
                                                 else "has returned") for r in others]
        text = f"{error}. The other ranks:\n" + "\n".join(lines)
        if isinstance(error, LaunchTimeoutError):
            return LaunchTimeoutError(f"launch timed out: {text}", error.timeout, {})
        return DistError(text)

    def _status(self, rank: int) -> str:
        if not self.processes[rank].is_alive():
            return f"its process has ended (status {self.processes[rank].exitcode})"
        try:
            self.status[rank].send("status?")
            if self.status[rank].poll(GRACE):
                return self.status[rank].recv()
        except (EOFError, OSError):
            pass
        return "no answer (busy in a long computation?)"

    def close(self) -> None:
        """Stop the processes: asked, then SIGTERM, then SIGKILL."""
        for connection in self.connections:
            try:
                connection.send_bytes(b"stop")
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + GRACE
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(GRACE)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self.connections + self.status:
            connection.close()
        self.processes, self.connections, self.status = [], [], []


