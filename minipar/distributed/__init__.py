"""minipar.distributed: a virtual GPU cluster in one process, shaped like torch.distributed.

    from minipar import distributed as dist

    def worker(x):
        mesh = dist.DeviceMesh(dp=2, tp=2)
        return dist.all_reduce(x * dist.get_rank(), group=mesh.dp_group())

    results = dist.launch(worker, 4, np.ones(3))            # one result per rank
    results, devices = dist.launch(worker, 4, np.ones(3), return_devices=True)
    devices[0].summary()          # memory, bytes sent/received, simulated time of rank 0

Modules: launch (threads and rank context), cluster (rendezvous, deadlock detection),
collectives, p2p, ring (collectives on send/recv), groups and mesh, device (one rank's
ledgers), memory and buffers (what a rank holds, and for how long), tiers (host memory
and NVMe behind each GPU, and the copies between them), clock, timeline
(busy/idle time, the bubble and the communication compute hides, from the clocks'
timelines), trace (Chrome Trace Event files per rank, as torch.profiler writes them),
comm_log (the byte ledger), allocator (freed arrays kept in the process for the next
step), errors.
"""

from __future__ import annotations

from .buffers import compute, hold, release, transient
from .clock import (
    A100,
    H100,
    Clock,
    DeviceProfile,
    TimelineEvent,
    collective_time,
    tier_copy_time,
)
from .cluster import MAX_WORLD_SIZE, Cluster
from .collectives import (
    CollectiveWork,
    all_gather,
    all_reduce,
    all_reduce_bytes,
    all_to_all,
    barrier,
    broadcast,
    reduce,
    reduce_scatter,
    ring_chunk_bytes,
)
from .comm_log import GROUP_KINDS, PHASES, CommLedger, CommRecord, traffic_matrix
from .context import get_device, get_rank, get_world_size
from .device import Device
from .errors import (
    CollectiveMismatchError,
    DeadlockError,
    DistError,
    LaunchCancelled,
    LaunchTimeoutError,
    RankAborted,
)
from .groups import ProcessGroup, new_group
from .launch import (
    DEFAULT_TIMEOUT,
    Cancellation,
    launch,
    launch_timeout,
    phase,
    timeline_label,
)
from .memory import CATEGORIES, MemoryLedger
from .mesh import DeviceMesh
from .p2p import Work, irecv, isend, recv, send
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .roofline import Roofline
from .tiers import (
    TIERS,
    TransferLedger,
    copy_into,
    copy_to_device,
    copy_to_host,
    host_compute,
    swap_in,
    swap_out,
    wait_transfers,
)
from .timeline import comm_overlap, device_comm_overlap
from .trace import TraceError, read_traces, write_traces

__all__ = [
    "A100",
    "CATEGORIES",
    "Cancellation",
    "DEFAULT_TIMEOUT",
    "GROUP_KINDS",
    "H100",
    "MAX_WORLD_SIZE",
    "PHASES",
    "TIERS",
    "Clock",
    "Cluster",
    "CollectiveMismatchError",
    "CommLedger",
    "CollectiveWork",
    "CommRecord",
    "DeadlockError",
    "Device",
    "DeviceMesh",
    "DeviceProfile",
    "DistError",
    "LaunchCancelled",
    "LaunchTimeoutError",
    "MemoryLedger",
    "ProcessGroup",
    "RankAborted",
    "Roofline",
    "TimelineEvent",
    "TraceError",
    "TransferLedger",
    "Work",
    "all_gather",
    "all_reduce",
    "all_reduce_bytes",
    "all_to_all",
    "barrier",
    "broadcast",
    "collective_time",
    "comm_overlap",
    "compute",
    "device_comm_overlap",
    "copy_into",
    "copy_to_device",
    "copy_to_host",
    "get_device",
    "get_rank",
    "get_world_size",
    "hold",
    "host_compute",
    "irecv",
    "isend",
    "launch",
    "launch_timeout",
    "new_group",
    "phase",
    "recv",
    "reduce",
    "read_traces",
    "reduce_scatter",
    "release",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_chunk_bytes",
    "ring_reduce_scatter",
    "send",
    "swap_in",
    "swap_out",
    "tier_copy_time",
    "timeline_label",
    "transient",
    "traffic_matrix",
    "write_traces",
    "wait_transfers",
]
