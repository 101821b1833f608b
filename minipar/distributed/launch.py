"""launch(fn, world_size): run fn once per virtual rank, each in its own thread.

The emulator's `torchrun` / `mp.spawn`. Each thread gets its own rank context (for
get_rank, the collectives and the autograd device) and nothing else is shared, so
launches never leak state into each other. If any rank raises, the others are woken and
stopped at their next communication or compute call, and `launch` re-raises that
rank's exception (with `.rank` set and a note naming the rank).
"""

from __future__ import annotations

import contextlib
import threading

from threadpoolctl import threadpool_limits

from minipar.autograd.tracking import use_device

from .clock import DeviceProfile
from .cluster import Cluster
from .comm_log import PHASES
from .context import _rank_context, get_device
from .errors import DistError, RankAborted
from .p2p import finish_pending


def _run_rank(cluster: Cluster, rank: int, fn, args, kwargs, results: list) -> None:
    device = cluster.devices[rank]
    _rank_context.set((cluster, device))  # this thread's context only
    try:
        with use_device(device):
            results[rank] = fn(*args, **kwargs)
            finish_pending(device)
    except RankAborted:
        pass  # another rank failed first; launch reports that one
    except BaseException as error:  # noqa: BLE001 - any failure must abort the launch
        with cluster.lock:
            cluster.fail(error, rank)
    finally:
        with cluster.lock:
            cluster.rank_returned(rank)


def launch(
    fn,
    world_size: int,
    *args,
    gpus_per_node: int = 8,
    device: DeviceProfile | None = None,
    return_devices: bool = False,
    **kwargs,
):
    """Run fn(*args, **kwargs) on `world_size` virtual ranks; return results by rank.

    gpus_per_node: ranks per node (rank r lives on node r // gpus_per_node).
    device: the DeviceProfile every rank simulates (default: H100 SXM, see clock.py).
    return_devices: also return every rank's Device (memory, clock, comm ledgers):
        `results, devices = launch(fn, 8, return_devices=True)`.
    """
    cluster = Cluster(world_size, gpus_per_node, device)
    results: list = [None] * world_size
    threads = [
        threading.Thread(
            target=_run_rank,
            args=(cluster, rank, fn, args, kwargs, results),
            name=f"minipar-rank-{rank}",
            daemon=True,  # a rank stuck in user code must not keep the interpreter alive
        )
        for rank in range(world_size)
    ]
    # One BLAS thread per rank. The ranks are already the parallelism: letting each of N
    # rank threads also fan every matmul out to OpenBLAS's own pool oversubscribes the
    # cores and made an 8-rank step ~80x slower on a busy 2-core machine (and a
    # 1-rank step ~25x). threadpool_limits restores the previous setting on exit.
    with threadpool_limits(limits=1, user_api="blas"):
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        except BaseException as interrupt:  # e.g. KeyboardInterrupt in a notebook
            with cluster.lock:
                cluster.fail(interrupt, None)
            for thread in threads:
                thread.join()
            raise
    if cluster.failure is not None:
        error, rank = cluster.failure, cluster.failed_rank
        if rank is not None and not isinstance(error, DistError):
            error.rank = rank
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"(raised on rank {rank} of {world_size} in "
                               f"minipar.distributed.launch)")
        raise error
    return (results, cluster.devices) if return_devices else results


@contextlib.contextmanager
def phase(name: str):
    """Charge the running rank's communication inside the block to phase `name`
    (forward | backward | optimizer | other)."""
    if name not in PHASES:
        raise ValueError(f"phase {name!r} is not one of {PHASES}")
    device = get_device()
    previous = device.phase
    device.phase = name
    try:
        yield
    finally:
        device.phase = previous


@contextlib.contextmanager
def timeline_label(label: str):
    """Attach `label` to the running rank's compute events inside the block (the pipeline
    labels each micro-batch's forward "F3" and backward "B3" for the timeline plot)."""
    clock = get_device().clock
    previous = clock.compute_label
    clock.compute_label = str(label)
    try:
        yield
    finally:
        clock.compute_label = previous
