"""Simulated time: a device profile, the alpha-beta cost of communication, a per-rank clock.

Nothing here reads the wall clock. Compute advances a rank's clock by FLOPs / (FLOP/s)
(the uniform model: the default profile), or, on a profile with a roofline (`H100`,
`A100`), by each kernel's roofline time: GEMMs by their shape, elementwise ops by the
bytes they move (minipar.distributed.roofline; the planner prices the same kernels the
same way). Communication follows the alpha-beta model (Hockney 1994): a message of S
bytes over a link with latency alpha and bandwidth B takes alpha + S/B. So timelines,
bubbles and overlap describe the simulated cluster, and are the same on every run and
every laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .roofline import A100_SXM_80GB, H100_SXM_80GB, Roofline

COMPUTE_KINDS = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class DeviceProfile:
    """The hardware one virtual rank stands for. Defaults: one GPU of an 8 x H100 SXM node
    (NVLink 4 inside the node, one 400 Gb/s InfiniBand NDR adapter per GPU across nodes).

    flops: sustained FLOP/s. The H100 SXM datasheet gives 989 TFLOP/s dense BF16 tensor
        core peak (1979 "with sparsity"); large training runs sustain ~40% of it (Llama 3
        report, Dubey et al. 2024, Table 4: 38-43% BF16 MFU on H100). We take 400 TFLOP/s.
    intra_node_bandwidth: bytes/s one GPU sends in one direction over NVLink 4: 900 GB/s
        bidirectional per GPU (H100 datasheet), so 450 GB/s. This is the link rate;
        NCCL's measured all-reduce bus bandwidth on a DGX H100 is lower (~350-480 GB/s
        depending on NVLink SHARP), so treat comm times as optimistic by up to ~25%.
    inter_node_bandwidth: 400 Gb/s NDR InfiniBand per GPU (ConnectX-7, one per GPU in a
        DGX H100) = 50 GB/s per direction. Again the link rate, not a measured one.
    intra_node_latency, inter_node_latency: seconds per message / ring step (alpha).
        NCCL's own cost model (src/graph/tuning.cc, table hwLat) charges 3.4 us per ring
        step over NVLink with its bulk "Simple" protocol (0.6 us with low-latency "LL"),
        and several microseconds more per network step; we take 3 us and 8 us.
    roofline: None (the default) charges every FLOP at `flops`: the uniform model, whose
        clean identities (bubble (p-1)/(m+p-1), compute proportional to FLOPs) the tests
        and docs rely on. A Roofline prices each kernel an op reports instead (`H100`,
        `A100` below); `flops` is then only the fallback for work reported without kernels.
    """

    name: str = "H100-SXM (NVLink 4, 400 Gb/s IB NDR)"
    flops: float = 400e12
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    intra_node_latency: float = 3e-6
    inter_node_latency: float = 8e-6
    roofline: Roofline | None = None

    def __post_init__(self) -> None:
        for setting in ("flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, setting)
            if not value > 0:
                raise ValueError(f"DeviceProfile.{setting} must be > 0, got {value}")
        for setting in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, setting)
            if not value >= 0:
                raise ValueError(f"DeviceProfile.{setting} must be >= 0, got {value}")

    def compute_seconds(self, flops: float, kernels=None) -> float:
        """Seconds of work of `flops` FLOPs, reported as `kernels` (a sequence of
        minipar.autograd.kernels.Kernel, or None)."""
        if self.roofline is None or kernels is None:
            return flops / self.flops
        return self.roofline.total_seconds(kernels)

    def link(self, same_node: bool) -> tuple[float, float]:
        """(latency alpha in s, bandwidth B in bytes/s) of the slowest link a transfer crosses."""
        if same_node:
            return self.intra_node_latency, self.intra_node_bandwidth
        return self.inter_node_latency, self.inter_node_bandwidth


# One GPU of a DGX node priced on its roofline: the profiles `minipar train --device h100 /
# a100` simulate and the planner's h100-80gb / a100-80gb presets use (same links).
H100 = DeviceProfile(name="H100-SXM roofline (NVLink 4, 400 Gb/s IB NDR)",
                     flops=H100_SXM_80GB.peak_flops, roofline=H100_SXM_80GB)
A100 = DeviceProfile(name="A100-SXM-80GB roofline (NVLink 3, 200 Gb/s IB HDR)",
                     flops=A100_SXM_80GB.peak_flops, intra_node_bandwidth=300e9,
                     inter_node_bandwidth=25e9, roofline=A100_SXM_80GB)


def collective_time(op: str, n: int, nbytes: int, alpha: float, bandwidth: float) -> float:
    """Alpha-beta time of a ring collective over n ranks; nbytes is the full tensor S.

    Ring formulas (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009):
      all_reduce        2(n-1) alpha + 2(n-1)/n S/B   (reduce-scatter then all-gather)
      all_gather,
      reduce_scatter     (n-1) alpha +  (n-1)/n S/B
      broadcast, reduce  (n-1) alpha +          S/B   (pipelined chain along the ring)
      barrier           2(n-1) alpha                  (an all-reduce of nothing)
    """
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth
    if op in ("broadcast", "reduce"):
        return (n - 1) * alpha + nbytes / bandwidth
    if op == "barrier":
        return 2 * (n - 1) * alpha
    raise ValueError(f"no cost model for collective {op!r}")


@dataclass
class TimelineEvent:
    """One stretch of a rank's timeline. kind: forward | backward | optimizer | comm | idle."""

    kind: str
    start: float
    end: float
    label: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Clock:
    """A rank's simulated clock (seconds) and its timeline.

    compute_s  time spent computing (forward, backward, optimizer)
    comm_s     time blocked while data moves
    idle_s     time waiting for peers to arrive (a collective starts with its last member)
    compute_label  text attached to compute events (e.g. "F3": forward of micro-batch 3),
                   set with `minipar.distributed.timeline_label`; compute under another label
                   starts a new event, so a plot can name each micro-batch
    """

    now: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    compute_label: str = ""
    events: list[TimelineEvent] = field(default_factory=list)

    def _append(self, kind: str, start: float, end: float, label: str = "") -> None:
        last = self.events[-1] if self.events else None
        # Back-to-back compute of one kind is one event: a step's forward pass reports
        # hundreds of ops, and a plot needs one bar, not hundreds.
        if last is not None and last.kind == kind and last.label == label and last.end == start:
            last.end = end
        else:
            self.events.append(TimelineEvent(kind, start, end, label))

    def compute(self, seconds: float, kind: str) -> None:
        """Advance by `seconds` of compute of `kind` (forward | backward | optimizer)."""
        if seconds <= 0:
            return
        start = self.now
        self.now = start + seconds
        self.compute_s += seconds
        self._append(kind, start, self.now, self.compute_label)

    def wait_until(self, t: float) -> None:
        """Idle until simulated time t (no-op if already past it)."""
        if t > self.now:
            self.idle_s += t - self.now
            self._append("idle", self.now, t)
            self.now = t

    def communicate(self, start: float, end: float, label: str) -> None:
        """Idle until `start`, then be busy communicating until `end`.

        If the rank arrives after `start` (an isend completed in the background while it
        computed), only the part of the transfer it actually waits for counts as comm.
        """
        self.wait_until(start)
        if end > self.now:
            self.comm_s += end - self.now
            self._append("comm", self.now, end, label)
            self.now = end

    def summary(self) -> dict:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "idle_s": self.idle_s}
