"""The torch engine: one OS process per rank, torch.distributed's gloo backend between them.

    with TorchEngine(nproc_per_node=4) as engine:       # 4 processes on this machine
        launched = engine.launch(fn, 4, *args)          # fn runs in each, as rank 0..3

The processes come from one of two places:

  started here  `nproc_per_node` processes on this machine, from multiprocessing's
                forkserver (torch is imported once, in the server; each rank is a fork of
                it), meeting at a rendezvous store (torch's TCPStore) that this process
                holds on a free port of 127.0.0.1. They stay up from launch to launch (one
                start-up for `minipar check`'s many runs) until close() or a failure.
  torchrun      RANK and WORLD_SIZE are in the environment (torchrun sets them, with
                MASTER_ADDR and MASTER_PORT; so can a user, by hand): this process is one
                rank of the job and joins it (init_process_group("gloo", "env://")). The
                results are gathered to rank 0 (torch's gather_object), where launch returns
                them; it returns None on the other ranks.

Each rank runs fn in a rank context as a thread of launch.py does, with a MeasuredDevice
(measured.py) and a TorchCluster (torch_cluster.py), one BLAS thread per process as one per
thread there.

Failures end in one error, within the launch timeout (launch.py's, used as gloo's):
  - a rank that raises: the others are stopped (SIGTERM, then SIGKILL) and launch raises
    that rank's exception with `.rank`, a note, and its traceback as the cause;
  - a wait that times out (a peer that never calls, ranks on different groups) or a peer
    that is gone: LaunchTimeoutError / DistError naming the call, and the flight recorder
    of every rank (what it waits in, its last call), which a small thread of each rank
    process answers;
  - a rank process that dies without a word (killed, out of memory): its exit status;
  - Ctrl-C: the rank processes ignore SIGINT; this process stops them and re-raises.
Under torchrun the first rank to fail writes its error to the store and raises it; the
others then exit with status 1 without a word of their own, and torchrun stops the rest.
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
from minipar.errors import ConfigError

from .clock import DeviceProfile
from .context import _rank_context
from .engine import Engine, Launched, versions
from .errors import DistError, LaunchTimeoutError, PeerLostError
from .launch import resolve_timeout
from .measured import MeasuredDevice, wall_trace
from .p2p import finish_pending
from .trace import dump_traces, write_traces
from .wire import WireMeter, socket_fds

GRACE = 2.0  # seconds a stopped rank, or a status reply, gets
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
    "recv": "(what a receiver sends back: gloo's acknowledgements)",
    "clock exchange (minipar)": "not the rank program's: a 24-byte stamp per member and "
                                "collective, a header and a reply per message",
}
_TO_HOST = None  # in a rank process started here: its connection to the launching process


# ------------------------------------------------------------------ one rank, in its process
def join(rank: int, world_size: int, address: str, port: int, timeout: float, *,
         from_environment: bool = False):
    """init_process_group (gloo) as `rank`, and this process's TorchWorld."""
    import torch
    import torch.distributed as tdist

    from .torch_cluster import TorchWorld

    torch.set_num_threads(1)  # the ranks are the parallelism (launch.py, threadpool_limits)
    delta = datetime.timedelta(seconds=timeout)
    before = socket_fds()
    try:
        if from_environment:
            tdist.init_process_group("gloo", init_method="env://", rank=rank,
                                     world_size=world_size, timeout=delta)
        else:
            store = tdist.TCPStore(address, port, world_size, False, delta)
            tdist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                     timeout=delta)
    except (RuntimeError, ValueError, TimeoutError, OSError) as error:
        raise rendezvous_error(error, address, port, timeout) from None
    meter = WireMeter({port})
    return TorchWorld(rank, world_size, meter, meter.adopt(socket_fds() - before), timeout)


def rendezvous_error(error: BaseException, address: str, port: int, timeout: float):
    """One line for a rendezvous that failed, naming the endpoint and the fix."""
    text = str(error)
    where = f"{address}:{port}"
    if "in use" in text or "EADDRINUSE" in text:
        return DistError(f"the rendezvous port {where} is in use (another job, or one still "
                         "exiting): choose a free one (MASTER_PORT, or torchrun's "
                         "--rdzv-endpoint HOST:PORT)")
    if "not known" in text or "getaddrinfo" in text or "resolve" in text:
        return DistError(f"the rendezvous host {address!r} is unknown: check MASTER_ADDR "
                         "(torchrun's --rdzv-endpoint HOST:PORT)")
    return DistError(f"could not join the job at the rendezvous {where} within {timeout:g} s "
                     f"({text.strip().splitlines()[-1] if text.strip() else type(error).__name__}"
                     "): is rank 0's node running there, and are MASTER_ADDR / MASTER_PORT "
                     "(torchrun's --rdzv-endpoint) and WORLD_SIZE the same on every node?")


def run_rank(world, job: dict, state: dict | None = None):
    """Run job["fn"] as this process's rank: (its result, its Device, what was measured)."""
    import torch.distributed as tdist

    from .torch_cluster import TorchCluster

    profile = job["device"] if job["device"] is not None else DeviceProfile()
    gpus_per_node = job["gpus_per_node"]
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
            for ready in wait_for(list(waiting)):
                rank = waiting[ready]
                if rank not in pending:
                    continue
                try:
                    message = self.connections[rank].recv()
                except (EOFError, OSError):
                    raise self._failure(rank, None) from None
                if message[0] == "call":
                    _, key, method, args = message
                    getattr(self.relays[key], method)(*args)
                elif message[0] == kind:
                    outcomes[rank] = message[2]
                    pending.discard(rank)
                else:
                    raise self._failure(rank, message)
        return outcomes

    def _failure(self, rank: int, message) -> BaseException:
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
        deadline = time.monotonic() + GRACE
        others = [r for r in range(self.world_size) if r != rank]
        while time.monotonic() < deadline:
            for ready in wait_for([self.connections[r] for r in others],
                                  max(0.0, deadline - time.monotonic())):
                r = self.connections.index(ready)
                try:
                    other = ready.recv()
                except (EOFError, OSError):
                    continue
                if other[0] == "error":
                    cause = rebuild(r, self.world_size, *other[2:])
                    if not isinstance(cause, LaunchTimeoutError | PeerLostError):
                        return cause  # a rank's own error: the others only lost it
            break
        lines = [f"rank {r}: {self._status(r)}" for r in others]
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


# ------------------------------------------------------------------ the engine
def engine_section(world_size: int, hosts: list, launcher: str, nproc_per_node, startup: float,
                   timeout: float) -> dict:
    """The report's `engine` section of a run on the torch engine."""
    return {"name": "torch", "backend": "gloo", "world_size": world_size, "hosts": hosts,
            "launcher": launcher, "nproc_per_node": nproc_per_node, "startup_s": startup,
            "timeout_s": timeout, "versions": versions()}


class TorchEngine(Engine):
    """The engine of one OS process per rank (the module docstring)."""

    name = "torch"

    def __init__(self, nproc_per_node: int | None = None, timeout: float | None = None) -> None:
        try:
            import torch.distributed as tdist
        except ImportError:
            raise ConfigError("engine", "torch needs PyTorch: pip install 'minipar[torch]' "
                              "(torch==2.13.0)") from None
        if not tdist.is_available() or not tdist.is_gloo_available():
            raise ConfigError("engine", "torch needs torch.distributed with gloo, which this "
                              "build of PyTorch lacks")
        if nproc_per_node is not None and (isinstance(nproc_per_node, bool) or not isinstance(
                nproc_per_node, int) or nproc_per_node < 1):
            raise ConfigError("nproc_per_node", f"must be an integer >= 1, got "
                              f"{nproc_per_node!r}")
        self.nproc_per_node, self.timeout = nproc_per_node, resolve_timeout(timeout)
        self.joined = Joined.from_environment(self.timeout)
        self._pool: Pool | None = None
        self._relays: dict[int, object] = {}  # engine.relay's targets, by key

    @property
    def is_host(self) -> bool:
        return self.joined is None or self.joined.rank == 0

    def launch(self, fn, world_size: int, *args, gpus_per_node: int = 8, device=None,
               trace: bool = False, timeout: float | None = None, **kwargs) -> Launched | None:
        job = {"fn": fn, "args": args, "kwargs": kwargs, "gpus_per_node": gpus_per_node,
               "device": device, "trace": trace,
               "timeout": self.timeout if timeout is None else resolve_timeout(timeout)}
        if self.joined is not None:
            return self.joined.launch(job, world_size, self.nproc_per_node)
        nproc = self.nproc_per_node or world_size
        if nproc != world_size:
            raise ConfigError("nproc_per_node", f"{nproc} processes on this machine, but the "
                              f"layout has {world_size} ranks: use --nproc-per-node "
                              f"{world_size}, or torchrun --nnodes N --nproc-per-node "
                              f"{world_size}/N on N machines")
        if self._pool is None or self._pool.world_size != world_size:
            self.close()
            self._pool = Pool(world_size, job["timeout"], self._relays)
        pool = self._pool
        try:
            outcomes = pool.run(job)
        except BaseException:  # a failed rank, Ctrl-C: the processes are out of step
            self.close()
            raise
        results, devices, measured = (list(x) for x in zip(*outcomes, strict=True))
        return Launched(results, devices, measured, engine=engine_section(
            world_size, pool.hosts, "minipar", world_size, pool.startup_s, job["timeout"]))

    def shared(self, fn):
        return fn() if self.joined is None else self.joined.shared(fn)

    def relay(self, target):
        if self.joined is not None:
            return None  # the other ranks' processes are not ours to call back from
        key = len(self._relays)
        self._relays[key] = target
        return Relay(key)

    def write_traces(self, directory, launched: Launched, steps, wall_steps, metadata):
        """The measured traces in `directory` (rank<N>.json on the wall clock, what
        `minipar profile` and HTA read), the simulated ones in `directory`/simulated."""
        from pathlib import Path

        write_traces(Path(directory) / "simulated", launched.devices, steps, metadata)
        dump_traces(directory, [wall_trace(device, wall_steps[i], metadata[i],
                                           GLOO_ALGORITHMS)
                                for i, device in enumerate(launched.devices)])

    def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()


class Joined:
    """This process as one rank of a job started elsewhere (torchrun): the environment's
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch's env:// rendezvous)."""

    def __init__(self, rank: int, world_size: int, address: str, port: int,
                 timeout: float) -> None:
        self.rank, self.world_size, self.address, self.port = rank, world_size, address, port
        self.timeout, self.world, self.hosts, self.startup_s = timeout, None, [], 0.0

    @classmethod
    def from_environment(cls, timeout: float) -> Joined | None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        values = {}
        for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
            text = os.environ.get(name, "")
            if not text.strip().isdigit():
                raise ConfigError("engine", f"the environment variable {name}={text!r} must be "
                                  "an integer (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and "
                                  "MASTER_PORT)")
            values[name] = int(text)
        if values["RANK"] >= values["WORLD_SIZE"]:
            raise ConfigError("engine", f"RANK={values['RANK']} is outside WORLD_SIZE="
                              f"{values['WORLD_SIZE']}")
        return cls(values["RANK"], values["WORLD_SIZE"], os.environ.get("MASTER_ADDR",
                   "127.0.0.1"), values["MASTER_PORT"], timeout)

    def _join(self):
        if self.world is None:
            import torch.distributed as tdist

            began = time.perf_counter()
            self.world = join(self.rank, self.world_size, self.address, self.port,
                              self.timeout, from_environment=True)
            self.hosts = [None] * self.world_size
            tdist.all_gather_object(self.hosts, socket.gethostname())
            self.startup_s = time.perf_counter() - began
        return self.world

    def launch(self, job: dict, world_size: int, nproc_per_node: int | None):
        import torch.distributed as tdist

        if world_size != self.world_size:
            raise ConfigError("engine", f"the layout has {world_size} ranks but the job has "
                              f"WORLD_SIZE={self.world_size} processes (torchrun --nnodes x "
                              f"--nproc-per-node): make them equal")
        world = self._join()
        try:
            outcome = run_rank(world, job)
        except BaseException as error:
            self._first_failure(error)
            raise
        gathered = [None] * world_size if self.rank == 0 else None
        tdist.gather_object(outcome, gathered, dst=0)
        if self.rank != 0:
            return None
        results, devices, measured = (list(x) for x in zip(*gathered, strict=True))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node or 0)) or None
        return Launched(results, devices, measured, engine=engine_section(
            world_size, self.hosts, "torchrun", local, self.startup_s, job["timeout"]))

    def shared(self, fn):
        import torch.distributed as tdist

        self._join()
        value = [fn() if self.rank == 0 else None]
        tdist.broadcast_object_list(value, src=0)
        return value[0]

    def _first_failure(self, error: BaseException) -> None:
        """Say the job failed, in the store; if another rank said so first, leave quietly
        (its error is the one to read, and torchrun stops this process anyway)."""
        import torch.distributed as tdist

        try:
            store = tdist.TCPStore(self.address, self.port, None, False,
                                   datetime.timedelta(seconds=GRACE))
            mine = f"rank {self.rank}: {error}".encode()
            first = store.compare_set("minipar/failed", "", mine)
        except Exception:  # noqa: BLE001 - no store (it is gone): say it ourselves
            return
        if first != mine:
            raise SystemExit(1) from None
