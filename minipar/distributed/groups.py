"""Process groups: the set of ranks a collective runs over, and who pays for its bytes.

A group is a sorted tuple of global ranks (as torch.distributed sorts them) plus a *kind*
(dp | tp | pp | other) that the byte ledger charges its traffic to. Groups are plain
values: creating one needs no rendezvous, because the emulator knows every rank, and two
ranks that build the same group get equal objects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .comm_log import GROUP_KINDS
from .context import current


@dataclass(frozen=True)
class ProcessGroup:
    """ranks: global ranks in ring order (sorted); kind: dp | tp | pp | cp | other."""

    ranks: tuple[int, ...]
    kind: str = "other"
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {r: i for i, r in enumerate(self.ranks)})

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def group_rank(self, rank: int) -> int:
        """Index of global `rank` in this group (its position on the ring)."""
        try:
            return self._index[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not a member of {self}") from None

    def __str__(self) -> str:
        return f"{self.kind} group {list(self.ranks)}"


@functools.lru_cache(maxsize=1024)  # a step asks for the same few groups again
def nodes_spanned(ranks: tuple[int, ...], gpus_per_node: int) -> int:
    """How many nodes a group's ranks sit on (rank r on node r // gpus_per_node): a
    ring crosses the network once from each to the next (clock.collective_time)."""
    return len({r // gpus_per_node for r in ranks})


def make_group(ranks, kind: str, world_size: int) -> ProcessGroup:
    """Validated ProcessGroup over `ranks` of a world of `world_size` ranks."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"group kind {kind!r} is not one of {GROUP_KINDS}")
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("a process group needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"process group ranks {ranks} contain duplicates")
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise ValueError(
            f"process group names rank(s) {outside} outside the world of {world_size} ranks "
            f"(valid ranks are 0..{world_size - 1})"
        )
    return ProcessGroup(tuple(sorted(ranks)), kind)


def new_group(ranks, kind: str = "other") -> ProcessGroup:
    """A group over global `ranks` (any order; stored sorted), charged to `kind`.

    Every member must build it with the same ranks and kind (as with torch.distributed;
    on the torch engine, every rank, member or not, in the same order, unless a DeviceMesh
    built it already). Must be called inside a launch: the world size bounds the ranks.
    """
    cluster, device = current("new_group()")
    group = make_group(ranks, kind, device.world_size)
    cluster.create_groups(lambda: [group])
    return group
