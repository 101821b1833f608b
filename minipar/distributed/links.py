"""The wires between virtual GPUs as the simulated clock prices them: which link a group
of ranks crosses, and what a collective costs on it.

    links = Links(gpus_per_node, profile)
    alpha, bandwidth = links.link((0, 1))                     # NVLink, or the network
    seconds = links.collective_seconds("all_reduce", (0, 1, 2, 3), nbytes)

Both clusters (threads: cluster.py; torch.distributed processes: torch_cluster.py) hold
one `Links` and ask it, so the two engines charge the same time by construction. Each
answer is a pure function of the profile, the GPUs per node, the ranks and the bytes,
and a training step asks the same few questions every micro-batch (the same buckets,
the same TP activations), so each is worked out once and remembered.
"""

from __future__ import annotations

from .clock import DeviceProfile, collective_time
from .groups import nodes_spanned

# Distinct (op, ranks, bytes) remembered; beyond it (routing-dependent all-to-all sizes
# over a long run) a collective is priced afresh, at the cost it always had.
REMEMBERED = 4096


class Links:
    """The links and collective times of one cluster's ranks."""

    def __init__(self, gpus_per_node: int, profile: DeviceProfile) -> None:
        self.gpus_per_node, self.profile = gpus_per_node, profile
        self._links: dict[tuple[int, ...], tuple[float, float]] = {}
        self._collectives: dict[tuple, float] = {}

    def link(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(alpha, bandwidth) of the slowest link between `ranks`: NVLink if they share a
        node, else the inter-node network."""
        if ranks not in self._links:
            self._links[ranks] = self.profile.link(nodes_spanned(ranks, self.gpus_per_node) == 1)
        return self._links[ranks]

    def collective_seconds(self, op: str, ranks: tuple[int, ...], nbytes: int) -> float:
        """Seconds of collective `op` over `ranks` on a full tensor of `nbytes`
        (clock.collective_time: a ring laid node by node)."""
        key = (op, ranks, nbytes)
        seconds = self._collectives.get(key)
        if seconds is None:
            alpha, bandwidth = self.link(ranks)
            seconds = collective_time(op, len(ranks), nbytes, alpha, bandwidth,
                                      nodes_spanned(ranks, self.gpus_per_node),
                                      self.profile.intra_node_latency)
            if len(self._collectives) < REMEMBERED:
                self._collectives[key] = seconds
        return seconds
