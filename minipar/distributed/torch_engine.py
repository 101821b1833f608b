"""The torch engine: one OS process per rank, torch.distributed's gloo backend between them.

    with TorchEngine(nproc_per_node=4) as engine:       # 4 processes on this machine
        launched = engine.launch(fn, 4, *args)          # fn runs in each, as rank 0..3

The processes come from one of two places:

  started here  `nproc_per_node` processes on this machine (processes.Pool), kept from
                launch to launch until close(), a failure, or the end of the program.
  torchrun      RANK and WORLD_SIZE are in the environment (torchrun sets them, with
                MASTER_ADDR and MASTER_PORT; so can a user, by hand): this process is one
                rank of the job and joins it (init_process_group("gloo", "env://")), on
                this machine or another. The results are gathered to rank 0 (torch's
                gather_object), where launch returns them; it returns None on the other
                ranks. The first rank to fail writes its error to the store and raises it;
                the others then exit with status 1 without a word of their own (their
                errors would only say a peer is gone), and torchrun stops the rest.

A run's traces on this engine are measured: rank<N>.json on the wall clock (measured.py),
the simulated clock's beside them in simulated/.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import time
import weakref
from pathlib import Path

from minipar.errors import ConfigError

from .engine import Engine, Launched, versions
from .launch import resolve_timeout
from .measured import wall_trace
from .processes import GLOO_ALGORITHMS, GRACE, Pool, Relay, run_rank
from .trace import dump_traces, write_traces


def engine_section(world_size: int, hosts: list, launcher: str, nproc_per_node, startup: float,
                   timeout: float) -> dict:
    """The report's `engine` section of a run on the torch engine."""
    return {"name": "torch", "backend": "gloo", "world_size": world_size, "hosts": hosts,
            "launcher": launcher, "nproc_per_node": nproc_per_node, "startup_s": startup,
            "timeout_s": timeout, "versions": versions()}


class TorchEngine(Engine):
    """The engine of one OS process per rank (the module docstring)."""

    name = "torch"
    in_process = False

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
    def elsewhere(self) -> bool:
        return self.joined is not None

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
            # stopped at exit too, if nobody closes the engine (atexit, before the
            # daemonic processes are terminated)
            self._finalizer = weakref.finalize(self, self._pool.close)
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
        write_traces(Path(directory) / "simulated", launched.devices, steps, metadata)
        dump_traces(directory, [
            wall_trace(device, [(n, s - device.epoch, e - device.epoch)  # (perf_counter)
                                for n, s, e in wall_steps[i]], metadata[i], GLOO_ALGORITHMS)
            for i, device in enumerate(launched.devices)])

    def close(self) -> None:
        if self._pool is not None:
            self._pool = None
            self._finalizer()  # (pool.close, once)


class Joined:
    """This process as one rank of a job started elsewhere (torchrun): the environment's
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch's env:// rendezvous)."""

    def __init__(self, rank: int, world_size: int, address: str, port: int,
                 timeout: float) -> None:
        self.rank, self.world_size, self.address, self.port = rank, world_size, address, port
        self.timeout, self.world, self.hosts, self.startup_s = timeout, None, [], 0.0
        self.failed = False

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

            from .torch_world import join

            began = time.perf_counter()
            self.world = join(self.rank, self.world_size, self.address, self.port,
                              self.timeout, from_environment=True)
            self.hosts = [None] * self.world_size
            tdist.all_gather_object(self.hosts, socket.gethostname())
            self.startup_s = time.perf_counter() - began
            atexit.register(self._leave)
        return self.world

    def _leave(self) -> None:
        """At exit, after a run that did not fail: everyone is done before anyone closes
        its connections (a peer's gloo would see them close under its feet), and gloo's
        worker threads are joined while the interpreter is still whole.

        Why the join: a gloo worker thread can hold the last reference to a finished
        collective, and so to tensors made from NumPy arrays; freeing them takes the GIL.
        A thread that asks for the GIL once the interpreter is finalizing is ended
        mid-destructor, and the process aborts ("terminate called without an active
        exception", exit -6; pytorch/pytorch#179291). destroy_process_group() only
        forgets torch's references; dropping ours too runs ProcessGroupGloo's destructor,
        which waits for its queue and joins its threads with the GIL released
        (torch/csrc/distributed/c10d/init.cpp, IntrusivePtrNoGilDestructor)."""
        import torch.distributed as tdist

        if self.failed or not tdist.is_initialized():
            return
        try:
            tdist.barrier()
            tdist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        if self.world is not None:
            self.world.close()
            self.world = None
        gc.collect()  # (a group reachable only through a reference cycle goes now, too)

    def launch(self, job: dict, world_size: int, nproc_per_node: int | None):
        import torch.distributed as tdist

        try:
            if world_size != self.world_size:
                raise ConfigError("engine", f"the layout has {world_size} ranks but the job "
                                  f"has WORLD_SIZE={self.world_size} processes (torchrun "
                                  "--nnodes x --nproc-per-node): make them equal")
            outcome = run_rank(self._join(), job)
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

        self.failed = True
        try:
            store = tdist.TCPStore(self.address, self.port, None, False,
                                   datetime.timedelta(seconds=GRACE))
            mine = f"rank {self.rank}: {error}".encode()
            first = store.compare_set("minipar/failed", "", mine)
        except Exception:  # noqa: BLE001 - no store (it is gone): say it ourselves
            return
        if first != mine:
            raise SystemExit(1) from None
