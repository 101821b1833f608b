"""Engines: what runs the ranks of a launch. Threads in this process, or one OS process each.

    engine = get_engine("threads")                      # the default: launch.py's threads
    engine = get_engine("torch", nproc_per_node=4)      # torch.distributed, gloo, 4 processes
                                                        # (engines.py; torch_engine.py)
    launched = engine.launch(fn, 4, *args, gpus_per_node=8, trace=False)
    launched.results, launched.devices, launched.measured, launched.engine

The rank program is the same on both: it calls minipar.distributed (collectives, send /
recv, DeviceMesh, phases) and never the engine. Both engines give every rank the same
`Device` (byte ledger, memory ledger, simulated clock, trace recorder), and the cluster
protocol that collectives.py and p2p.py call on the running rank's cluster

    collective(rank, group, number, call, combine, wait)  join the k-th collective of a group
    wait_collective(rank, handle)                         wait for an asynchronous one
    post(side, src, dst, tag, array, now)                 post one side of a message
    wait_transfer(rank, handle, side)                     wait for it to be matched
    link(ranks)                                           (alpha, bandwidth) between ranks
    create_groups(groups)                                 groups every process creates
    world, world_size, gpus_per_node, failure, check_alive()

fixes when each transfer starts and ends on the simulated clock by the same rule, so the
ledgers and the clocks of a run are the same figures on either engine
(`cluster.Cluster` on threads, `torch_cluster.TorchCluster` on processes). What differs is
only what a real engine can measure besides: wall time in communication, and the bytes
on the sockets (`Launched.measured`, one dict per rank; empty on threads).

A run on the torch engine also works under `torchrun` (RANK and WORLD_SIZE in the
environment): each process then joins the job as one rank, and the results are
gathered to rank 0, where `launch` returns them; it returns None on the other ranks.
"""

from __future__ import annotations

import platform
import socket
import sys
from dataclasses import dataclass

from .launch import launch as launch_threads
from .trace import write_traces


@dataclass
class Launched:
    """What a launch gives back, in rank order: what each rank's function returned, its
    Device (ledgers, clock), and what the engine measured (None on threads)."""

    results: list
    devices: list
    measured: list[dict] | None = None
    engine: dict | None = None  # the report's `engine` section: name, backend, hosts, ...


class Engine:
    """The interface: `launch` runs fn on every rank; the rest is what the training loop
    needs from the engine that hosts the run."""

    name = ""
    in_process = True  # the ranks share this process's memory (a list they append to)

    def launch(self, fn, world_size: int, *args, gpus_per_node: int = 8, device=None,
               trace: bool = False, timeout: float | None = None, **kwargs) -> Launched | None:
        raise NotImplementedError

    @property
    def elsewhere(self) -> bool:
        """Whether this process is one rank of a job started elsewhere (torchrun)."""
        return False

    @property
    def is_host(self) -> bool:
        """Whether this process gets the results (False: another rank of a torchrun job)."""
        return True

    def shared(self, fn):
        """fn() computed once, on the host, and its value on every process of the job
        (the single-device reference a checked run compares with)."""
        return fn()

    def relay(self, target):
        """An object the ranks may call methods of, the calls running on `target` in the
        host process (progress reports); None where the ranks cannot reach it."""
        return target

    def write_traces(self, directory, launched: Launched, steps, wall_steps, metadata):
        """rank<N>.json per rank in `directory` (trace.py's format)."""
        write_traces(directory, launched.devices, steps, metadata)

    def close(self) -> None:
        """Stop what the engine keeps running between launches (nothing, on threads)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ThreadEngine(Engine):
    """Every rank a thread of this process (launch.py): the embedded default."""

    name = "threads"

    def launch(self, fn, world_size: int, *args, gpus_per_node: int = 8, device=None,
               trace: bool = False, timeout: float | None = None, **kwargs) -> Launched:
        results, devices = launch_threads(fn, world_size, *args, gpus_per_node=gpus_per_node,
                                          device=device, return_devices=True,
                                          timeout=timeout, trace=trace, **kwargs)
        # nothing measured by the engine itself: the training loop's wall marks only
        return Launched(results, devices, [{} for _ in results], engine={
            "name": self.name, "backend": "threads", "world_size": world_size,
            "hosts": [socket.gethostname()], "versions": versions()})


def versions() -> dict:
    """The versions a report names: Python, NumPy, torch when loaded, the platform."""
    import numpy

    found = {"python": platform.python_version(), "numpy": numpy.__version__,
             "platform": platform.platform(terse=True)}
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = torch.__version__
    return found
