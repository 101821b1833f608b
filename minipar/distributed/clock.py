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

import functools
from dataclasses import dataclass, field

from .roofline import A100_SXM_80GB, H100_SXM_80GB, Roofline

COMPUTE_KINDS = ("forward", "backward", "optimizer")
# Work the host CPU does for a rank (ZeRO-Offload's CPU Adam), priced by `host_flops`.
HOST_COMPUTE_KINDS = ("host_optimizer",)


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

    The offload tiers (ZeRO-Offload / ZeRO-Infinity; minipar/distributed/tiers.py):
    pcie_bandwidth: bytes/s between one GPU and host memory, per direction (PCIe is full
        duplex, so a copy down and a copy up run at once). PCIe Gen5 x16 is 32 GT/s x 16
        lanes with 128b/130b coding = 63 GB/s per direction, theoretical; pinned-memory
        copies on H100 measure ~50-55 GB/s (NVIDIA's nvbandwidth host_to_device /
        device_to_host tests). We take 50 GB/s. (ZeRO-Offload's V100s had Gen3 x16,
        ~12 GB/s: the paper's whole design is about crossing PCIe as little as possible.)
    pcie_latency: seconds per copy: a cudaMemcpyAsync of a few bytes costs ~5-10 us of
        launch and DMA set-up; we take 10 us.
    nvme_read_bandwidth, nvme_write_bandwidth: one datacenter Gen5 NVMe SSD per GPU (a
        DGX H100 ships 8 U.2 data drives for 8 GPUs). Samsung PM1743 datasheet: 13.0 GB/s
        sequential read, 6.6 GB/s sequential write (128 KiB blocks, queue depth 32).
        DeepSpeed's async I/O (`deepspeed/ops/aio`, the ZeRO-Infinity paper's section 6.3)
        issues large blocks in parallel to approach the sequential rates.
    nvme_latency: seconds per request: ~80-100 us for a read at low queue depth on the
        same drives' datasheets; we take 100 us.
    host_flops: FLOP/s of the host CPU cores serving one GPU, running DeepSpeed's CPU-Adam
        (`csrc/adam/cpu_adam_impl.cpp`: AVX-512 SIMD, OpenMP threads, tiled), which
        DeepSpeed's ZeRO-Offload tutorial puts at 5-7x PyTorch's CPU Adam. ZeRO-Offload
        (Ren et al. 2021, Table 2, as we read it; not re-checked here, so verify before
        quoting) has CPU-Adam updating 1B parameters in ~0.22 s on a DGX-2 host's 2 x
        24-core Xeon Platinum 8168 (~4.5e9 parameters/s, ~1e8 per core).
        An 8-GPU H100 host has ~112 cores, ~14 per GPU: ~1.4e9 parameters/s per rank, x 14
        FLOPs of AdamW per parameter (minipar.nn.optim) = ~20 GFLOP/s. We take 20e9:
        20,000x slower than the GPU, which is why only the optimizer step, O(Psi) work,
        moves to the CPU and never forward or backward, O(tokens x Psi).
    """

    name: str = "H100-SXM (NVLink 4, 400 Gb/s IB NDR)"
    flops: float = 400e12
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    intra_node_latency: float = 3e-6
    inter_node_latency: float = 8e-6
    roofline: Roofline | None = None
    pcie_bandwidth: float = 50e9
    pcie_latency: float = 10e-6
    nvme_read_bandwidth: float = 13.0e9
    nvme_write_bandwidth: float = 6.6e9
    nvme_latency: float = 100e-6
    host_flops: float = 20e9

    def __post_init__(self) -> None:
        for setting in ("flops", "intra_node_bandwidth", "inter_node_bandwidth",
                        "pcie_bandwidth", "nvme_read_bandwidth", "nvme_write_bandwidth",
                        "host_flops"):
            value = getattr(self, setting)
            if not value > 0:
                raise ValueError(f"DeviceProfile.{setting} must be > 0, got {value}")
        for setting in ("intra_node_latency", "inter_node_latency", "pcie_latency",
                        "nvme_latency"):
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

    def tier_link(self, direction: str) -> tuple[float, float]:
        """(latency in s, bandwidth in bytes/s) of a copy between tiers: direction is
        to_host or to_device (PCIe), nvme_read or nvme_write (the NVMe drive)."""
        if direction in ("to_host", "to_device"):
            return self.pcie_latency, self.pcie_bandwidth
        if direction == "nvme_read":
            return self.nvme_latency, self.nvme_read_bandwidth
        if direction == "nvme_write":
            return self.nvme_latency, self.nvme_write_bandwidth
        raise ValueError(f"no link for a copy {direction!r}")


def device_label(values: dict) -> str:
    """A simulated GPU in words for a reader who did not choose it: its name and how it
    prices compute. `values`: a DeviceProfile's fields (dataclasses.asdict), as a report's
    `device` section and a trace keep them.

        H100-SXM (NVLink 4, 400 Gb/s IB NDR), every FLOP at 400 TFLOP/s whatever the kernel
        H100-SXM roofline (...), each kernel on its roofline (GEMMs by shape, others by bytes)
    """
    if values.get("roofline") is not None:
        return (f"{values['name']}, each kernel on its roofline (GEMMs by shape, other ops "
                "by bytes moved)")
    flops = values["flops"]
    unit, scale = next(((u, s) for u, s in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12),
                                           ("GFLOP/s", 1e9)) if flops >= s), ("FLOP/s", 1))
    return f"{values['name']}, every FLOP at {flops / scale:.3g} {unit} whatever the kernel"


def tier_copy_time(direction: str, nbytes: int, profile: DeviceProfile) -> float:
    """Seconds of one copy of nbytes between tiers: alpha + S/B (the same alpha-beta
    model as a message between GPUs)."""
    alpha, bandwidth = profile.tier_link(direction)
    return alpha + nbytes / bandwidth


# One GPU of a DGX node priced on its roofline: the profiles `minipar train --device h100 /
# a100` simulate and the planner's h100-80gb / a100-80gb presets use (same links).
H100 = DeviceProfile(name="H100-SXM roofline (NVLink 4, 400 Gb/s IB NDR)",
                     flops=H100_SXM_80GB.peak_flops, roofline=H100_SXM_80GB)
A100 = DeviceProfile(name="A100-SXM-80GB roofline (NVLink 3, 200 Gb/s IB HDR)",
                     flops=A100_SXM_80GB.peak_flops, intra_node_bandwidth=300e9,
                     inter_node_bandwidth=25e9, roofline=A100_SXM_80GB,
                     # PCIe Gen4 x16 on a DGX A100: 31.5 GB/s per direction, ~25 measured
                     pcie_bandwidth=25e9)


@functools.lru_cache(maxsize=4096, typed=True)  # pure; a step asks for the same sizes again
def collective_time(op: str, n: int, nbytes: int, alpha: float, bandwidth: float,
                    nodes: int = 1, intra_alpha: float | None = None) -> float:
    """Alpha-beta time of a ring collective over n ranks; nbytes is the full tensor S.

    Ring formulas (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009):
      all_reduce        2(n-1) alpha + 2(n-1)/n S/B   (reduce-scatter then all-gather)
      all_gather,
      reduce_scatter     (n-1) alpha +  (n-1)/n S/B
      broadcast, reduce  (n-1) alpha +          S/B   (pipelined chain along the ring)
      barrier           2(n-1) alpha                  (an all-reduce of nothing)
      all_to_all         (n-1) alpha +  (n-1)/n S/B   (n-1 pairwise exchanges; S is
                                                       one rank's buffer)

    A ring over `nodes` > 1 nodes (alpha, B: the network's; intra_alpha: NVLink's) lays
    each node's members next to each other, as NCCL builds its rings, so only the steps
    from one node to the next cross the network: nodes - 1 of a pass around the ring
    (2 (nodes - 1) for an all-reduce or a barrier), at alpha, and the others hop over
    NVLink at intra_alpha, whatever the members a node. NCCL's own cost model counts
    the latency of a ring all-reduce, all-gather and reduce-scatter this way (NCCL
    2.30, src/graph/tuning.cc, ncclTopoTuneModel: `(nsteps - nInterSteps) * intraLat
    + nInterSteps * interLat`): a pipelined chunk crosses the network only between
    nodes. It differs in two details minipar leaves out: it raises the NVLink steps of
    a multi-node ring to its network overhead (a few us), and prices a broadcast or
    reduce by its channels, not by this split, which minipar applies to the chain too.
    An all-to-all is pairwise: each of its n - 1 exchanges is charged the slowest
    link's alpha.
    """
    if n <= 1:
        return 0.0
    passes = 2 if op in ("all_reduce", "barrier") else 1
    latency = passes * (n - 1) * alpha
    if nodes > 1 and op != "all_to_all":
        if intra_alpha is None:
            raise ValueError("collective_time: a ring across nodes needs intra_alpha")
        inter = passes * (min(nodes, n) - 1)
        latency = inter * alpha + (passes * (n - 1) - inter) * intra_alpha
    if op == "all_reduce":
        return latency + 2 * (n - 1) / n * nbytes / bandwidth
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return latency + (n - 1) / n * nbytes / bandwidth
    if op in ("broadcast", "reduce"):
        return latency + nbytes / bandwidth
    if op == "barrier":
        return latency
    raise ValueError(f"no cost model for collective {op!r}")


@dataclass
class TimelineEvent:
    """One stretch of a rank's timeline. kind: forward | backward | optimizer | comm | idle,
    and with offload: host_optimizer (the CPU's Adam) | transfer (waiting for a copy
    between GPU, host and NVMe)."""

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
    host_compute_s  time the host CPU computes for this rank while it waits (CPU Adam)
    transfer_s      time blocked while data moves between GPU, host memory and NVMe
    compute_label  text attached to compute events (e.g. "F3": forward of micro-batch 3),
                   set with `minipar.distributed.timeline_label`; compute under another label
                   starts a new event, so a plot can name each micro-batch
    """

    now: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    host_compute_s: float = 0.0
    transfer_s: float = 0.0
    compute_label: str = ""
    events: list[TimelineEvent] = field(default_factory=list)

    def _append(self, kind: str, start: float, end: float, label: str = "") -> None:
        events = self.events
        if events:
            last = events[-1]
            # Back-to-back compute of one kind is one event: a step's forward pass reports
            # hundreds of ops, and a plot needs one bar, not hundreds.
            if last.end == start and last.kind == kind and last.label == label:
                last.end = end
                return
        events.append(TimelineEvent(kind, start, end, label))

    def compute(self, seconds: float, kind: str) -> None:
        """Advance by `seconds` of compute of `kind` (forward | backward | optimizer)."""
        if seconds <= 0:
            return
        start = self.now
        self.now = start + seconds
        self.compute_s += seconds
        self._append(kind, start, self.now, self.compute_label)

    def host_compute(self, seconds: float, kind: str = "host_optimizer") -> None:
        """Advance by `seconds` the host CPU computes for this rank (the GPU waits)."""
        if seconds <= 0:
            return
        start = self.now
        self.now = start + seconds
        self.host_compute_s += seconds
        self._append(kind, start, self.now, self.compute_label)

    def wait_transfer(self, end: float, label: str) -> None:
        """Be blocked until a copy between tiers ends at `end` (no-op if it already has:
        an asynchronous copy that ran while the rank computed)."""
        if end > self.now:
            self.transfer_s += end - self.now
            self._append("transfer", self.now, end, label)
            self.now = end

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
        """compute_s, comm_s, idle_s; and host_compute_s, transfer_s when the rank offloads
        (their sum is the rank's simulated time)."""
        summary = {"compute_s": self.compute_s, "comm_s": self.comm_s, "idle_s": self.idle_s}
        if self.host_compute_s or self.transfer_s:
            summary.update(host_compute_s=self.host_compute_s, transfer_s=self.transfer_s)
        return summary
