"""The memory tiers behind one GPU: host (CPU DRAM) and NVMe, and every copy between them.

ZeRO-Offload (Ren et al. 2021) keeps the optimizer state in host memory and runs Adam on
the CPU; ZeRO-Infinity (Rajbhandari et al. 2021) adds NVMe below it, for the optimizer
state and for ZeRO-3's parameters. A virtual GPU therefore has three ledgers
(`Device.memory`, `Device.memory_host`, `Device.memory_nvme`, each a `MemoryLedger` with
the same categories) and two links: a PCIe link to the host (full duplex: one queue per
direction) and an NVMe drive (one queue, reads and writes share it).

    host = dist.copy_to_host(piece, "grads", async_op=True)   # GPU -> host, booked
    dist.wait_transfers()                                      # the step needs it
    gpu = dist.copy_to_device(master, "buffers")               # host -> GPU, blocks
    dist.hold(state, "optimizer", tier="nvme")                 # lives on the drive
    with dist.swap_in(state) as host_copy: ...                 # NVMe -> host buffer
    dist.swap_out(host_copy, state)                            # host -> NVMe

Every copy is booked in the rank's `TransferLedger` (to_host_bytes, to_device_bytes,
nvme_read_bytes, nvme_write_bytes: the report's `ranks[i].transfers`) and priced on its
simulated clock: a copy starts when its queue is free and the rank asks for it, and takes
alpha + S/B (`DeviceProfile.tier_link`, clock.py). A blocking copy makes the rank wait
for its end ("transfer" on the timeline); an `async_op=True` copy runs while the rank
computes on (a CUDA copy on a side stream, `non_blocking=True`) and the rank only waits
for it in `wait_transfers()`. Which copies overlap is the strategy's decision, made where
DeepSpeed makes it (minipar/parallel/zero/offload.py).

The arrays of every tier are NumPy arrays in this process: a tier is where the ledger
books them and what a copy costs, exactly as the GPU "tier" is.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .context import get_device

TIERS = ("gpu", "host", "nvme")
DIRECTIONS = ("to_host", "to_device", "nvme_read", "nvme_write")
_LABELS = {"to_host": "copy to host", "to_device": "copy to GPU",
           "nvme_read": "NVMe read", "nvme_write": "NVMe write"}
# Which queue each direction waits in: PCIe down, PCIe up, the NVMe drive.
_QUEUES = {"to_host": "pcie_down", "to_device": "pcie_up", "nvme_read": "nvme",
           "nvme_write": "nvme"}


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"memory tier {tier!r} is not one of {TIERS}")
    return tier


class TransferLedger:
    """Bytes one rank copied between its tiers, per direction, and when each queue is free.

    bytes[d]   total bytes copied in direction d over the run
    copies[d]  number of copies in direction d
    free_at[q] simulated time queue q (pcie_down, pcie_up, nvme) finishes its last copy
    """

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self.copies = dict.fromkeys(DIRECTIONS, 0)
        self.free_at = dict.fromkeys(("pcie_down", "pcie_up", "nvme"), 0.0)

    def summary(self) -> dict:
        """The report's `ranks[i].transfers`."""
        return {**{f"{d}_bytes": self.bytes[d] for d in DIRECTIONS},
                "copies": dict(self.copies)}


def _copy(nbytes: int, direction: str, async_op: bool) -> None:
    """Book one copy of nbytes and put it on the clock (blocking unless async_op)."""
    device = get_device()
    ledger, clock = device.transfers, device.clock
    queue = _QUEUES[direction]
    start = max(clock.now, ledger.free_at[queue])
    latency, bandwidth = device.profile.tier_link(direction)
    end = start + latency + nbytes / bandwidth
    ledger.free_at[queue] = end
    ledger.bytes[direction] += nbytes
    ledger.copies[direction] += 1
    if not async_op:
        clock.wait_transfer(end, _LABELS[direction])


def copy_to_host(array: np.ndarray, category: str = "buffers", *,
                 async_op: bool = False) -> np.ndarray:
    """A host copy of a GPU array, held in the host ledger under `category` (the caller
    releases it). async_op: the rank does not wait (see `wait_transfers`)."""
    host = array.copy()
    get_device().memory_host.hold(host, category)
    _copy(host.nbytes, "to_host", async_op)
    return host


def copy_to_device(array: np.ndarray, category: str = "buffers") -> np.ndarray:
    """A GPU copy of a host array, held in the GPU ledger under `category`; blocks (the
    caller is about to use it)."""
    gpu = array.copy()
    get_device().memory.hold(gpu, category)
    _copy(gpu.nbytes, "to_device", async_op=False)
    return gpu


def copy_into(destination: np.ndarray, source: np.ndarray, direction: str, *,
              async_op: bool = False) -> None:
    """Copy `source` into an existing array of another tier (direction: to_host,
    to_device, nvme_read, nvme_write), casting to the destination's dtype. The bytes
    that cross are the source's: cast before the copy to send fewer."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")
    destination[...] = source
    _copy(source.nbytes, direction, async_op)


@contextlib.contextmanager
def swap_in(array: np.ndarray, category: str = "buffers"):
    """Read an NVMe-resident array into a host buffer, alive inside the block
    (DeepSpeed's swap-in into a pinned buffer, `swap_tensor/`). Blocks."""
    device = get_device()
    host = array.copy()
    device.memory_host.hold(host, category)
    _copy(host.nbytes, "nvme_read", async_op=False)
    try:
        yield host
    finally:
        device.memory_host.release(host)


def swap_out(host: np.ndarray, array: np.ndarray, *, async_op: bool = False) -> None:
    """Write a host buffer back to its NVMe-resident array."""
    copy_into(array, host, "nvme_write", async_op=async_op)


def wait_transfers() -> None:
    """Wait until every copy this rank started has finished (a stream synchronize)."""
    device = get_device()
    for queue, end in device.transfers.free_at.items():
        device.clock.wait_transfer(end, f"wait for {queue.replace('_', ' ')}")


def host_compute(flops: float, kind: str = "host_optimizer") -> None:
    """The host CPU computes `flops` for this rank (CPU Adam); the rank waits for it."""
    device = get_device()
    device.clock.host_compute(flops / device.profile.host_flops, kind)
