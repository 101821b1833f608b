"""The device mesh: world ranks laid out as a dp x pp x tp grid.

tp varies fastest, then pp, then dp (picotron's `torch.arange(world).view(dp, pp, tp)`):

    rank = (dp_index * pp + pp_index) * tp + tp_index

Tensor parallelism talks the most (an all-reduce per layer, forward and backward), so
its groups are consecutive ranks and stay inside a node, on NVLink, whenever tp divides
gpus_per_node (Megatron-LM, Narayanan et al. 2021, section 3.3: "tensor model
parallelism ... within a multi-GPU server"). Megatron itself orders pp slowest
(tp-dp-pp); the two differ only in which of dp and pp crosses nodes first.

Example, dp=2, pp=2, tp=2 (8 ranks):
    tp groups [0,1] [2,3] [4,5] [6,7];  pp groups [0,2] [1,3] [4,6] [5,7];
    dp groups [0,4] [1,5] [2,6] [3,7]
"""

from __future__ import annotations

from .context import _rank_context
from .groups import ProcessGroup, make_group

AXES = ("dp", "pp", "tp")


class DeviceMesh:
    """dp x pp x tp grid over the world. Inside a launch the sizes must multiply to the
    world size; outside one (e.g. for a planner), pass world_size or let it be the product.

    Methods taking `rank=None` mean the running rank.
    """

    def __init__(
        self,
        dp: int = 1,
        pp: int = 1,
        tp: int = 1,
        *,
        world_size: int | None = None,
        gpus_per_node: int | None = None,
    ) -> None:
        for axis, size in zip(AXES, (dp, pp, tp), strict=True):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"DeviceMesh {axis}={size!r}: every size must be an int >= 1")
        context = _rank_context.get()
        if context is not None:
            cluster = context[0]
            world_size = cluster.world_size if world_size is None else world_size
            gpus_per_node = cluster.gpus_per_node if gpus_per_node is None else gpus_per_node
        self.dp, self.pp, self.tp = dp, pp, tp
        self.world_size = dp * pp * tp if world_size is None else world_size
        self.gpus_per_node = 8 if gpus_per_node is None else gpus_per_node
        if dp * pp * tp != self.world_size:
            raise ValueError(
                f"DeviceMesh dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, but the world "
                f"has {self.world_size}: choose sizes whose product is {self.world_size}"
            )
        self._groups: dict[tuple[str, int], ProcessGroup] = {}

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)

    # --- coordinates ---------------------------------------------------------------------
    def _rank(self, rank: int | None) -> int:
        if rank is None:
            context = _rank_context.get()
            if context is None:
                raise RuntimeError("DeviceMesh: pass rank= outside minipar.distributed.launch")
            return context[1].rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        return rank

    def rank_at(self, dp: int, pp: int, tp: int) -> int:
        """Global rank at mesh coordinates (dp, pp, tp)."""
        return (dp * self.pp + pp) * self.tp + tp

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """{"dp": i, "pp": j, "tp": k} of `rank`."""
        rest, tp = divmod(self._rank(rank), self.tp)
        dp, pp = divmod(rest, self.pp)
        return {"dp": dp, "pp": pp, "tp": tp}

    def node(self, rank: int | None = None) -> int:
        return self._rank(rank) // self.gpus_per_node

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    # --- groups ----------------------------------------------------------------------------
    def group(self, axis: str, rank: int | None = None) -> ProcessGroup:
        """The group of ranks that share all coordinates of `rank` except `axis`."""
        if axis not in AXES:
            raise ValueError(f"mesh axis {axis!r} is not one of {AXES}")
        c = self.coords(rank)
        members = []
        for i in range(getattr(self, axis)):
            c[axis] = i
            members.append(self.rank_at(c["dp"], c["pp"], c["tp"]))
        key = (axis, members[0])
        if key not in self._groups:
            self._groups[key] = make_group(members, axis, self.world_size)
        return self._groups[key]

    def dp_group(self, rank: int | None = None) -> ProcessGroup:
        return self.group("dp", rank)

    def pp_group(self, rank: int | None = None) -> ProcessGroup:
        return self.group("pp", rank)

    def tp_group(self, rank: int | None = None) -> ProcessGroup:
        return self.group("tp", rank)

    def all_groups(self, axis: str) -> list[ProcessGroup]:
        """Every group along `axis`, ordered by first member."""
        unique = {self.group(axis, r) for r in range(self.world_size)}
        return sorted(unique, key=lambda g: g.ranks)

    def __repr__(self) -> str:
        return f"DeviceMesh(dp={self.dp}, pp={self.pp}, tp={self.tp})"
