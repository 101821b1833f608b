"""The byte ledger: what every communication call of a rank moved, and when.

One `CommRecord` per call and rank. Bytes are those the ring algorithm moves for *this*
rank (see `collectives.ring_chunk_bytes`), so they add up across ranks to the traffic on
the wires, and `ring.py`, which really runs the ring on send/recv, books the same figures.
Each record names the peers its bytes went to, so the summary can split them by link:
to a GPU of the same node (NVLink) or of another node (the network).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP_KINDS = ("dp", "tp", "pp", "cp", "ep", "other",
               # sub-groups of the data-parallel group (minipar/distributed/mesh.py): HSDP's
               # shard and replicate groups, ZeRO++'s secondary partition, qgZ's node levels
               "dp_shard", "dp_replicate", "dp_secondary", "dp_intra_node", "dp_inter_node")
# A ledger's by-group totals start with these (and gain "cp" or "ep" when such a group
# first sends: reports of runs without them keep their shape).
LEDGER_KINDS = ("dp", "tp", "pp", "other")
PHASES = ("forward", "backward", "optimizer", "other")


@dataclass(frozen=True)
class CommRecord:
    """One communication call as seen by one rank.

    op          all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | reduce
                | barrier | send | recv
    group_kind  dp | tp | pp | cp | ep | other (who the bytes are charged to; ep: the
                expert-parallel all-to-alls)
    group_ranks global ranks of the group, in ring order
    sent_bytes, recv_bytes   bytes this rank put on / took off the wire
    sent_to     ((peer global rank, bytes), ...): where the sent bytes went
    phase       forward | backward | optimizer | other (set with `minipar.distributed.phase`)
    start, end  simulated seconds: the transfer's start (its last member arrived) and end
    message     send / recv only: (src, dst, tag, n) = the n-th message on that channel,
                the same on both sides (a trace draws an arrow from the send to the recv)
    """

    op: str
    group_kind: str
    group_ranks: tuple[int, ...]
    sent_bytes: int
    recv_bytes: int
    sent_to: tuple[tuple[int, int], ...]
    phase: str
    start: float
    end: float
    message: tuple[int, int, int, int] | None = None


class CommLedger:
    """All CommRecords of one rank, with running totals. rank, gpus_per_node: where the
    rank is (rank // gpus_per_node is its node), to split its sent bytes by link."""

    def __init__(self, rank: int = 0, gpus_per_node: int = 8) -> None:
        self.rank, self.gpus_per_node = rank, gpus_per_node
        self.records: list[CommRecord] = []
        self.sent_bytes = 0
        self.recv_bytes = 0
        self.sent_by_op: dict[str, int] = {}
        self.recv_by_op: dict[str, int] = {}
        self.sent_by_group = dict.fromkeys(LEDGER_KINDS, 0)
        self.recv_by_group = dict.fromkeys(LEDGER_KINDS, 0)
        self.sent_by_group_phase: dict[str, dict[str, int]] = {}  # kind -> phase -> bytes

    def record(self, record: CommRecord) -> None:
        self.records.append(record)
        self.sent_bytes += record.sent_bytes
        self.recv_bytes += record.recv_bytes
        self.sent_by_op[record.op] = self.sent_by_op.get(record.op, 0) + record.sent_bytes
        self.recv_by_op[record.op] = self.recv_by_op.get(record.op, 0) + record.recv_bytes
        kind = record.group_kind
        self.sent_by_group[kind] = self.sent_by_group.get(kind, 0) + record.sent_bytes
        self.recv_by_group[kind] = self.recv_by_group.get(kind, 0) + record.recv_bytes
        if record.sent_bytes:
            phases = self.sent_by_group_phase.setdefault(kind, {})
            phases[record.phase] = phases.get(record.phase, 0) + record.sent_bytes

    @property
    def calls(self) -> int:
        return len(self.records)

    def summary(self) -> dict:
        """The report's "comm" entry. by_op and by_group count bytes *sent*; the matching
        received bytes are under recv_by_op and recv_by_group; by_group_phase splits the
        sent bytes of each group kind by phase (forward | backward | optimizer | other);
        by_link splits the sent bytes by where they went: intra_node (a GPU of my node)
        or inter_node (another node's)."""
        return {
            "sent_bytes": self.sent_bytes,
            "recv_bytes": self.recv_bytes,
            "calls": self.calls,
            "by_op": dict(self.sent_by_op),
            "by_group": dict(self.sent_by_group),
            "recv_by_op": dict(self.recv_by_op),
            "recv_by_group": dict(self.recv_by_group),
            "by_group_phase": {kind: dict(phases)
                               for kind, phases in self.sent_by_group_phase.items()},
            "by_link": self.sent_by_link(),
        }

    def sent_by_link(self) -> dict[str, int]:
        """{"intra_node": bytes, "inter_node": bytes} this rank sent (summed from the
        records' peers when asked: the report asks once, the calls never)."""
        node, per_node = self.rank // self.gpus_per_node, self.gpus_per_node
        by_link = {"intra_node": 0, "inter_node": 0}
        for record in self.records:
            for peer, nbytes in record.sent_to:
                by_link["intra_node" if peer // per_node == node else "inter_node"] += nbytes
        return by_link


def traffic_matrix(ledgers: list[CommLedger]) -> np.ndarray:
    """(world_size, world_size) int64 matrix: [i, j] = bytes rank i sent to rank j.

    `ledgers` are the ranks' CommLedgers in rank order (e.g. `[d.comm for d in devices]`).
    Row sums are each rank's sent_bytes, column sums its recv_bytes.
    """
    matrix = np.zeros((len(ledgers), len(ledgers)), dtype=np.int64)
    for src, ledger in enumerate(ledgers):
        for record in ledger.records:
            for dst, nbytes in record.sent_to:
                matrix[src, dst] += nbytes
    return matrix
