"""One virtual GPU: its rank and node, and what it measured (memory, time, bytes).

A Device is what `minipar.autograd.tracking.current_device()` returns inside a rank: the
autograd engine calls `device.compute(flops, kind, kernels)` for every op and `device.memory.hold`
/ `release` for the arrays it keeps. The collectives book their bytes in `device.comm`
and their time on `device.clock`. Behind the GPU are two more tiers (tiers.py): host
memory (`memory_host`) and an NVMe drive (`memory_nvme`), ledgers with the same
categories, and `transfers`, the bytes copied between them. A Device is only ever touched
by its own rank's thread.

`start_trace()` (called by `launch(..., trace=True)`) makes the device also keep what a
profiler trace needs and the summaries do not: every op's compute span (`trace`, a
TraceRecorder) and the memory ledger's history. Off by default, so untraced runs pay nothing.
"""

from __future__ import annotations

from minipar.autograd.tracking import _recomputing

from .clock import COMPUTE_KINDS, Clock, DeviceProfile
from .comm_log import PHASES, CommLedger
from .errors import RankAborted
from .memory import MemoryLedger
from .tiers import TransferLedger, check_tier
from .trace import TraceRecorder


class Device:
    """rank, world_size, node (= rank // gpus_per_node), profile, memory (the GPU's),
    memory_host, memory_nvme, transfers, clock, comm, phase."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        gpus_per_node: int = 8,
        profile: DeviceProfile | None = None,
        cluster=None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.gpus_per_node = gpus_per_node
        self.node = rank // gpus_per_node
        self.profile = profile if profile is not None else DeviceProfile()
        # Whether compute is priced per kernel (a roofline profile): only then do ops need
        # to describe their kernels (minipar.autograd.kernels). The profile never changes.
        self.wants_kernels = self.profile.roofline is not None
        self.memory = MemoryLedger()
        self.memory_host = MemoryLedger()
        self.memory_nvme = MemoryLedger()
        self.transfers = TransferLedger()
        self.clock = Clock()
        self.memory.moment = lambda: (self.clock.now, self._phase)  # when a peak happens
        self.comm = CommLedger(rank, gpus_per_node)
        self._phase = "other"
        # FLOPs of forwards run again inside backward (activation checkpointing); they
        # are also in the clock's "forward" time, where a profiler would show them.
        self.recompute_flops = 0.0
        # The Cluster of the running launch (None for a stand-alone device). Only read here
        # to stop promptly when another rank failed.
        self._cluster = cluster
        self._calls_per_group: dict[tuple[int, ...], int] = {}  # collective sequence numbers
        self._messages: dict[tuple[int, int, int], int] = {}  # p2p sequence numbers
        self.trace: TraceRecorder | None = None  # set by start_trace()
        self._pending_works: dict[int, object] = {}  # isend/irecv not yet waited, by id

    # --- the autograd device protocol --------------------------------------------------
    def compute(self, flops: float, kind: str, kernels=None, op: str = "") -> None:
        """Advance this rank's clock by `flops` of work of `kind` (forward|backward|optimizer),
        run as `kernels` (priced on the profile's roofline, if it has one); `op` names the
        operation (e.g. "Linear") for the trace."""
        cluster = self._cluster
        if cluster is not None and cluster.failure is not None:
            raise RankAborted  # another rank failed: stop here rather than compute on
        if kind not in COMPUTE_KINDS:
            raise ValueError(f"compute kind {kind!r} is not one of {COMPUTE_KINDS}")
        if _recomputing.get():  # (tracking.is_recomputing, without the call)
            self.recompute_flops += flops
        clock = self.clock
        start = clock.now
        clock.compute(self.profile.compute_seconds(flops, kernels), kind)
        if self.trace is not None and clock.now > start:
            self.trace.kernel(kind, op or kind, clock.compute_label, start, clock.now, flops)

    def lend_turn(self, flops: float) -> bool:
        """Let another rank run while this one spends `flops` in one NumPy call that
        releases the GIL (minipar.autograd.tracking.long_call; turns.py); True if lent."""
        cluster = self._cluster
        turns = getattr(cluster, "turns", None)  # (ranks of the thread engine only)
        if turns is None:
            return False
        with cluster.lock:
            return turns.lend(self.rank)

    def take_turn(self) -> None:
        """Take the turn again after a call it was lent for."""
        self._cluster.turns.take(self.rank)

    def start_trace(self) -> None:
        """Record every compute span and the memory history from now on (see trace.py)."""
        self.trace = TraceRecorder()
        self.memory.record_history(self.clock)

    def ledger(self, tier: str = "gpu") -> MemoryLedger:
        """The memory ledger of `tier` (gpu, host or nvme)."""
        check_tier(tier)
        return {"gpu": self.memory, "host": self.memory_host, "nvme": self.memory_nvme}[tier]

    def ledger_holding(self, array) -> MemoryLedger | None:
        """The ledger that holds `array` (its root buffer), or None."""
        for ledger in (self.memory, self.memory_host, self.memory_nvme):
            if ledger.is_held(array):
                return ledger
        return None

    # --- the phase communication is charged to -----------------------------------------
    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {PHASES}")
        self._phase = name

    def next_call_number(self, group_ranks: tuple[int, ...]) -> int:
        """Sequence number of this rank's next collective on the group with these ranks."""
        number = self._calls_per_group.get(group_ranks, 0)
        self._calls_per_group[group_ranks] = number + 1
        return number

    def next_message(self, channel: tuple[int, int, int]) -> tuple[int, int, int, int]:
        """(src, dst, tag, n): this rank's next message on the channel is its n-th."""
        number = self._messages.get(channel, 0)
        self._messages[channel] = number + 1
        return channel + (number,)

    def summary(self) -> dict:
        """One entry of the report's "ranks" list (the caller adds "coords")."""
        return {
            "rank": self.rank,
            "node": self.node,
            "memory": self.memory.summary(),
            "memory_at_peak": dict(self.memory.at_peak),
            "memory_host": self.memory_host.summary(),
            "memory_host_at_peak": dict(self.memory_host.at_peak),
            "memory_nvme": self.memory_nvme.summary(),
            "memory_nvme_at_peak": dict(self.memory_nvme.at_peak),
            "transfers": self.transfers.summary(),
            "comm": self.comm.summary(),
            "time": self.clock.summary(),
        }

    def __repr__(self) -> str:
        return f"Device(rank={self.rank}, world_size={self.world_size}, node={self.node})"
