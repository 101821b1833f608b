"""The hardware a plan runs on, and what moving bytes over it costs.

`ClusterSpec` is one GPU type in nodes of `gpus_per_node`, with a fast link inside the
node (NVLink) and a slower one between nodes (InfiniBand): the two-level topology every
3D-parallel layout is designed around. The world size is not part of it; a parallel
config (dp x tp x pp) says how many GPUs a plan uses.

Bytes per rank follow the ring algorithm (Patarasuk & Yuan 2009), which is also what
minipar's emulator books (minipar/distributed/collectives.py), including how `np.array_split`
cuts a tensor that does not divide evenly, so small tensors are exact too:

    all-reduce      2(n-1)/n S     reduce-scatter, all-gather   (n-1)/n S
    broadcast       S (every member but the chain's tail)       send/recv   S

Time is the alpha-beta model of minipar.distributed.clock.collective_time (Hockney 1994;
Thakur, Rabenseifner & Gropp 2005), with the bandwidth of the slowest link the group
crosses and the network's latency only on the ring's steps from one node to the next
(NVLink's on the others, as NCCL's own cost model counts them). Across nodes, NCCL
spreads a ring collective over the node's NICs (`rails` below): a group with m members
on each node crosses between nodes on m NICs at once.
minipar's emulator runs and times one ring, through one NIC; the planner prices NCCL on
the DGX presets and the emulator's single ring on the emulated ones (`nic_rails`).

Compute is priced one of two ways. With a `roofline` (minipar.distributed.roofline: the
GPU's tensor-core and HBM roofs, GEMM tile quantization; the a100/h100 presets), each
kernel of plan/kernels.py takes max(FLOPs / its compute rate, bytes / HBM bandwidth).
Without one, every FLOP costs 1 / (peak_flops x efficiency): the uniform model, which is
what minipar's default device profile simulates.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from minipar.distributed.attention_kernels import GEMM, MEASURED
from minipar.distributed.clock import DeviceProfile, collective_time
from minipar.distributed.roofline import Roofline

GIB = 2**30
EMULATOR_CALIBRATION = "minipar's emulator, which it matches (tests/plan/test_estimate.py)"


@dataclass(frozen=True)
class ClusterSpec:
    """One kind of GPU in nodes of `gpus_per_node`.

    memory_bytes: device memory per GPU. usable_memory_fraction: the part a plan may fill
        (the CUDA context, NCCL buffers and allocator fragmentation take the rest;
        1.0 for the emulator, whose ledger counts only arrays).
    peak_flops: dense 16-bit tensor-core peak per GPU (datasheet).
    efficiency: the fraction of peak every FLOP runs at when there is no roofline (the
        uniform model; the emulator's default profile charges every FLOP that way).
    roofline: the GPU's roofs (minipar.distributed.roofline.Roofline) to price each kernel
        by its shape and bytes; None for the uniform model.
    intra_node_bandwidth, inter_node_bandwidth: bytes/s one GPU sends in one direction.
    intra_node_latency, inter_node_latency: seconds per ring step (alpha).
    pcie_bandwidth, pcie_latency, nvme_read_bandwidth, nvme_write_bandwidth, nvme_latency,
        host_flops: the offload tiers behind each GPU (sources in
        minipar.distributed.clock.DeviceProfile): PCIe per direction, one NVMe drive, and
        the host cores' CPU-Adam rate.
    host_memory_bytes, nvme_bytes: host DRAM and NVMe capacity per GPU (a DGX H100: 2 TiB
        of DRAM and 8 x 3.84 TB U.2 drives for 8 GPUs).
    """

    name: str
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    efficiency: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    # The links' latencies and the offload tiers default to the emulator's device profile,
    # whose docstring cites each figure: one source for both (minipar.distributed.clock).
    intra_node_latency: float = DeviceProfile.intra_node_latency
    inter_node_latency: float = DeviceProfile.inter_node_latency
    usable_memory_fraction: float = 0.9
    roofline: Roofline | None = None
    pcie_bandwidth: float = DeviceProfile.pcie_bandwidth
    pcie_latency: float = DeviceProfile.pcie_latency
    nvme_read_bandwidth: float = DeviceProfile.nvme_read_bandwidth
    nvme_write_bandwidth: float = DeviceProfile.nvme_write_bandwidth
    nvme_latency: float = DeviceProfile.nvme_latency
    host_flops: float = DeviceProfile.host_flops
    host_memory_bytes: float = 256 * GIB
    nvme_bytes: float = 3.84e12
    # the published runs this profile's time model was fitted on and held against (None:
    # none; a plan on it says its times are uncalibrated)
    calibration: str | None = None
    # NCCL's rings across nodes spread over the node's NICs, one per GPU (`rails`): True
    # for a DGX's rail-optimized fabric; False for minipar's emulator, whose one ring
    # crosses between nodes on one NIC
    nic_rails: bool = True
    # Seconds of compute lost per second a data-parallel collective runs hidden behind
    # compute at NVLink's rate (nvlink_rate_share): NCCL's kernels take SMs and HBM
    # bandwidth from the GEMMs they overlap. 0: overlap is free, as on the emulator.
    overlap_contention: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"ClusterSpec.gpus_per_node must be a positive integer, got "
                             f"{self.gpus_per_node!r}")
        for name in ("memory_bytes", "peak_flops", "intra_node_bandwidth",
                     "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClusterSpec.{name} must be > 0, got {getattr(self, name)}")
        for name in ("efficiency", "usable_memory_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"ClusterSpec.{name} must be in (0, 1], got "
                                 f"{getattr(self, name)}")

    @property
    def sustained_flops(self) -> float:
        return self.peak_flops * self.efficiency

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def link(self, crosses_nodes: bool, nics: int = 1) -> tuple[float, float]:
        """(alpha in s, bandwidth in bytes/s) of a group inside one node or across nodes,
        on `nics` NICs at once (`rails`), as fast as NVLink at most but never slower than
        one NIC (whose rate is the network's whatever NVLink's, as the emulator's
        DeviceProfile.link has it)."""
        if crosses_nodes:
            one = self.inter_node_bandwidth
            return self.inter_node_latency, max(one, min(self.intra_node_bandwidth,
                                                         max(1, nics) * one))
        return self.intra_node_latency, self.intra_node_bandwidth

    def collective_time(self, op: str, n: int, nbytes: float, crossing: int) -> float:
        """Alpha-beta time of a ring collective of a full tensor of nbytes over n ranks.
        crossing: 0 inside one node, else the group's members per node (group_rails),
        the NICs a ring collective crosses nodes on at once with `nic_rails`; the ring's
        steps between nodes pay the network's latency, the others NVLink's
        (minipar.distributed.clock.collective_time), over the nodes a `Link` carries (a
        plain int m: n / m nodes, every node holding m of the group)."""
        nics = crossing if self.nic_rails and op in RING_COLLECTIVES else 1
        alpha, bandwidth = self.link(bool(crossing), nics)
        nodes = getattr(crossing, "nodes", -(-n // crossing) if crossing else 1)
        return collective_time(op, n, nbytes, alpha, bandwidth, nodes,
                               self.intra_node_latency)

    def nvlink_rate_share(self, crossing: int) -> float:
        """The rate a ring collective moves bytes at on this group's link (crossing as in
        collective_time), as a share of NVLink's: 1 inside a node, nics x NIC / NVLink
        across nodes. Contention with compute scales with it: a collective crossing
        nodes on one NIC moves bytes through the GPU's SMs and HBM 9x slower than one
        inside the node."""
        if not crossing:
            return 1.0
        nics = crossing if self.nic_rails else 1
        return self.link(True, nics)[1] / self.intra_node_bandwidth

    def tier_copy_time(self, direction: str, nbytes: float) -> float:
        """Seconds of one copy between tiers (to_host, to_device, nvme_read, nvme_write):
        alpha + S/B, as minipar.distributed.tiers prices it."""
        if direction in ("to_host", "to_device"):
            return self.pcie_latency + nbytes / self.pcie_bandwidth
        bandwidth = (self.nvme_read_bandwidth if direction == "nvme_read"
                     else self.nvme_write_bandwidth)
        return self.nvme_latency + nbytes / bandwidth

    def with_memory(self, memory_bytes: float) -> ClusterSpec:
        return replace(self, memory_bytes=memory_bytes)

    def with_attention_kernel(self, name: str) -> ClusterSpec:
        """This cluster with fused attention priced at kernel `name`'s measured rates
        (minipar.distributed.attention_kernels.MEASURED for this GPU), or as one GEMM
        ("gemm"). ValueError, naming the choices, if the GPU has no such measurement."""
        if self.roofline is None:
            raise ValueError("prices kernels on a roofline; this cluster prices every FLOP "
                             "at one rate (drop --efficiency)")
        measured = MEASURED.get(self.roofline.name, {})
        if name != GEMM and name not in measured:
            raise ValueError(f"{name!r} has no measured rates on {self.roofline.name}; "
                             f"choose one of {', '.join([*measured, GEMM])}")
        return replace(self, roofline=self.roofline.replace(attention=measured.get(name)))

    def uniform(self, efficiency: float | None = None) -> ClusterSpec:
        """This cluster without its roofline: every FLOP at peak x efficiency (a time
        model no published run calibrates)."""
        return replace(self, roofline=None, calibration=None,
                       efficiency=self.efficiency if efficiency is None else efficiency)

    @classmethod
    def from_device_profile(cls, profile: DeviceProfile | None = None, gpus_per_node: int = 8,
                            memory_bytes: float = 80 * GIB) -> ClusterSpec:
        """The cluster minipar's emulator simulates: every FLOP at `profile.flops`
        (efficiency 1), or each kernel on the profile's roofline if it has one; all of
        the memory usable."""
        profile = DeviceProfile() if profile is None else profile
        return cls(name=f"emulated {profile.name}", gpus_per_node=gpus_per_node,
                   memory_bytes=memory_bytes, efficiency=1.0, roofline=profile.roofline,
                   peak_flops=profile.flops if profile.roofline is None
                   else profile.roofline.peak_flops,
                   intra_node_bandwidth=profile.intra_node_bandwidth,
                   inter_node_bandwidth=profile.inter_node_bandwidth,
                   intra_node_latency=profile.intra_node_latency,
                   inter_node_latency=profile.inter_node_latency,
                   usable_memory_fraction=1.0, pcie_bandwidth=profile.pcie_bandwidth,
                   pcie_latency=profile.pcie_latency,
                   nvme_read_bandwidth=profile.nvme_read_bandwidth,
                   nvme_write_bandwidth=profile.nvme_write_bandwidth,
                   nvme_latency=profile.nvme_latency, host_flops=profile.host_flops,
                   nic_rails=False, calibration=EMULATOR_CALIBRATION)


# ---------------------------------------------------------------------- bytes per rank
def ring_chunk(numel: int, n: int, i: int) -> int:
    """Elements of chunk i of the n a ring cuts a flat tensor into (np.array_split: the
    first numel mod n chunks one element longer)."""
    base, extra = divmod(numel, n)
    return base + (i < extra)


def all_reduce_sent(numel: int, itemsize: int, n: int, position: int = 0) -> int:
    """Bytes ring position `position` sends in a ring all-reduce of numel elements:
    every chunk twice except chunks position+1 and position+2 once (2(n-1)/n S when n
    divides the tensor)."""
    if n <= 1:
        return 0
    once = ring_chunk(numel, n, (position + 1) % n) + ring_chunk(numel, n, (position + 2) % n)
    return itemsize * (2 * numel - once)


def all_gather_sent(piece_numel: int, itemsize: int, n: int) -> int:
    """Bytes a rank sends in a ring all-gather of equal pieces: (n-1) pieces."""
    return 0 if n <= 1 else (n - 1) * piece_numel * itemsize


def reduce_scatter_sent(numel: int, itemsize: int, n: int) -> int:
    """Bytes a rank sends in a ring reduce-scatter of a tensor of numel elements (n | numel):
    (n-1) chunks of numel/n."""
    return 0 if n <= 1 else (n - 1) * (numel // n) * itemsize


def broadcast_sent(nbytes: int, n: int, position_from_root: int) -> int:
    """Bytes a rank sends in a chain broadcast: all but the chain's tail send S."""
    return nbytes if n > 1 and position_from_root < n - 1 else 0


# ---------------------------------------------------------------------- topology
# Collectives NCCL runs as rings (or chains along one), which it spreads over channels;
# an all-to-all and a send are pairwise, every byte on its own GPU's NIC.
RING_COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                              "reduce", "barrier"})


class Link(int):
    """A group's entry of `group_links`: an int, its members a node (0 inside one node:
    `rails`), that also carries `nodes`, the most nodes one of its groups spans, which
    sets how many of a ring's steps cross the network (ClusterSpec.collective_time)."""

    nodes: int

    def __new__(cls, crossing: int, nodes: int) -> Link:
        link = super().__new__(cls, crossing)
        link.nodes = nodes
        return link


def rails(ranks, gpus_per_node: int) -> Link:
    """0 if `ranks` share a node; else how many NICs a ring collective over them crosses
    between nodes on at once: the fewest members the group has on any one node.

    A DGX H100 (and a DGX A100) has one NIC per GPU, each on its own "rail" (GPU i of
    every node on one leaf switch). NCCL cuts a ring collective into channels and routes
    each channel's hop between nodes through a different GPU's NIC (NVIDIA/nccl
    src/graph/search.cc, the ring search over the node's NICs), so a group with m
    members per node crosses between nodes on m NICs in parallel: its bandwidth is m x
    one NIC's, up to NVLink's. A group with one member per node (data parallelism across
    tensor-parallel nodes), a send, or an all-to-all (each GPU's own bytes leave on its
    own NIC) gets one."""
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
    return Link(min(per_node.values()) if len(per_node) > 1 else 0, len(per_node))



def group_crosses_nodes(size: int, stride: int, world: int, gpus_per_node: int) -> bool:
    """Does any group of `size` ranks spaced `stride` apart cross a node boundary?

    Groups of a dp x pp x tp mesh (rank = (dp_i pp + pp_i) tp + tp_i, tp fastest; see
    minipar.distributed.mesh) fill blocks of size x stride consecutive ranks, one group per
    offset 0 .. stride-1 of each block. A group spans [first, first + (size - 1) stride];
    it stays in one node only if that interval does. Nodes hold ranks
    [k gpus_per_node, (k+1) gpus_per_node).
    """
    if size <= 1:
        return False
    span = (size - 1) * stride + 1
    if span > gpus_per_node:
        return True
    block = size * stride
    if gpus_per_node % block == 0:
        return False  # blocks tile the nodes exactly
    # The pattern repeats every lcm(block, gpus_per_node) ranks: check one period.
    period = min(world, math.lcm(block, gpus_per_node))
    for start in range(0, period, block):
        for offset in range(stride):
            first = start + offset
            if first // gpus_per_node != (first + span - 1) // gpus_per_node:
                return True
    return False


@functools.cache
def group_rails(size: int, stride: int, world: int, gpus_per_node: int,
                inner: int = 1, inner_stride: int = 0) -> Link:
    """0 if the groups of `size` ranks spaced `stride` apart stay inside nodes, else the
    fewest members any group that crosses nodes has on one node: the NICs its ring
    collectives cross nodes on at once (`rails`); with, as `nodes`, the most nodes one
    group spans. inner, inner_stride: a second dimension folded into each group (the
    gradients' dp x cp group: cp ranks `inner_stride` apart inside each dp member's
    block of `stride`)."""
    if not (group_crosses_nodes(size, stride, world, gpus_per_node)
            or group_crosses_nodes(inner, inner_stride, world, gpus_per_node)):
        return Link(0, 1)
    block = size * stride
    period = min(world, math.lcm(block, gpus_per_node))  # the placement repeats after it
    fewest, nodes = gpus_per_node, 1
    for start in range(0, period, block):
        for offset in range(stride):
            if inner > 1 and (offset // inner_stride) % inner:
                continue  # a member of the group of an earlier offset
            link = rails([start + offset + i * stride + j * inner_stride
                          for i in range(size) for j in range(inner)], gpus_per_node)
            if link:
                fewest, nodes = min(fewest, link), max(nodes, link.nodes)
    return Link(fewest, nodes)
