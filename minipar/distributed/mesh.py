"""The device mesh: world ranks laid out as a dp x pp x cp x tp grid.

tp varies fastest, then cp, then pp, then dp (picotron's
`torch.arange(world).view(dp, pp, cp, tp)`):

    rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index

Context parallelism (cp, minipar/parallel/context/ring_attention.py) talks second most (K/V blocks
around its ring in every attention layer), so its groups come right after TP's and stay
inside a node when tp x cp divides gpus_per_node, as in Megatron-LM's
`parallel_state.initialize_model_parallel` (order "tp-cp-ep-dp-pp"). With cp = 1 the
mesh and its coordinates are the 3-D ones (no "cp" key), so older reports read the same.

Tensor parallelism talks the most (an all-reduce per layer, forward and backward), so
its groups are consecutive ranks and stay inside a node, on NVLink, whenever tp divides
gpus_per_node (Megatron-LM, Narayanan et al. 2021, section 3.3: "tensor model
parallelism ... within a multi-GPU server"). Megatron itself orders pp slowest
(tp-dp-pp); the two differ only in which of dp and pp crosses nodes first.

Expert parallelism lives inside the data-parallel group (Megatron-LM's expert-data-
parallel layout, parallel_state.py `initialize_model_parallel(expert_model_parallel_size)`):
the dp index splits as dp_index = edp_index * ep + ep_index, so an *expert-parallel group*
is ep consecutive dp indices (they hold different experts and exchange tokens by
all-to-all) and the *expert-data-parallel group* is the dp / ep ranks with the same
ep_index (they hold the same experts and reduce their gradients).

Example, dp=2, pp=2, tp=2 (8 ranks):
    tp groups [0,1] [2,3] [4,5] [6,7];  pp groups [0,2] [1,3] [4,6] [5,7];
    dp groups [0,4] [1,5] [2,6] [3,7]
Example, dp=2, cp=2, tp=2: tp [0,1] [2,3] ...; cp [0,2] [1,3] [4,6] [5,7]; dp [0,4] ...;
    and the group the gradients are averaged over, dp x cp ("dp-cp"), [0,2,4,6] [1,3,5,7]
    (Megatron's `get_data_parallel_group(with_context_parallel=True)`).
"""

from __future__ import annotations

import itertools

from .context import _rank_context
from .groups import ProcessGroup, make_group

AXES = ("dp", "pp", "cp", "tp")
# Groups over several axes: their name, axes, and the kind their bytes are charged to.
# Parameters are replicated over CP, so their gradients are averaged over DP x CP: that
# traffic is data-parallel traffic.
COMBINED = {"dp-cp": (("dp", "cp"), "dp")}


class DeviceMesh:
    """dp x pp x cp x tp grid over the world. Inside a launch the sizes must multiply to the
    world size; outside one (e.g. for a planner), pass world_size or let it be the product.

    Methods taking `rank=None` mean the running rank.
    """

    def __init__(
        self,
        dp: int = 1,
        pp: int = 1,
        tp: int = 1,
        *,
        cp: int = 1,
        world_size: int | None = None,
        gpus_per_node: int | None = None,
        ep: int = 1,
    ) -> None:
        for axis, size in zip(AXES, (dp, pp, cp, tp), strict=True):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"DeviceMesh {axis}={size!r}: every size must be an int >= 1")
        context = _rank_context.get()
        if context is not None:
            cluster = context[0]
            world_size = cluster.world_size if world_size is None else world_size
            gpus_per_node = cluster.gpus_per_node if gpus_per_node is None else gpus_per_node
        self.dp, self.pp, self.cp, self.tp = dp, pp, cp, tp
        size = dp * pp * cp * tp
        self.world_size = size if world_size is None else world_size
        self.gpus_per_node = 8 if gpus_per_node is None else gpus_per_node
        if size != self.world_size:
            sizes = f"dp={dp} x pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}"
            raise ValueError(
                f"DeviceMesh {sizes} = {size} ranks, but the world "
                f"has {self.world_size}: choose sizes whose product is {self.world_size}"
            )
        if not isinstance(ep, int) or ep < 1 or dp % ep:
            raise ValueError(f"DeviceMesh ep={ep!r}: expert parallelism splits the "
                             f"data-parallel group, so ep must divide dp={dp}")
        self.ep = ep
        self._groups: dict[tuple[str, int], ProcessGroup] = {}
        if context is not None:  # on engines whose every process creates every group
            context[0].create_groups(self.every_group)

    @property
    def shape(self) -> tuple[int, ...]:
        """(dp, pp, tp), or (dp, pp, cp, tp) with context parallelism (the `axes` order)."""
        return tuple(getattr(self, axis) for axis in self.axes)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axes, slowest first: ("dp", "pp", "tp"), with "cp" if cp > 1."""
        return AXES if self.cp > 1 else ("dp", "pp", "tp")

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

    def rank_at(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """Global rank at mesh coordinates (dp, pp, cp, tp)."""
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """{"dp": i, "pp": j, "tp": k} of `rank`, with "cp" (after "pp") if cp > 1."""
        rest, tp = divmod(self._rank(rank), self.tp)
        rest, cp = divmod(rest, self.cp)
        dp, pp = divmod(rest, self.pp)
        if self.cp == 1:
            return {"dp": dp, "pp": pp, "tp": tp}
        return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}

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

    @property
    def cp_rank(self) -> int:
        return self.coords().get("cp", 0)

    # --- groups ----------------------------------------------------------------------------
    def group(self, axis: str, rank: int | None = None) -> ProcessGroup:
        """The group of ranks that share all coordinates of `rank` except `axis` (or,
        for a combined name such as "dp-cp", except each of its axes)."""
        if axis not in AXES and axis not in COMBINED:
            raise ValueError(f"mesh axis {axis!r} is not one of {AXES + tuple(COMBINED)}")
        axes, kind = COMBINED.get(axis, ((axis,), axis))
        c = {"cp": 0, **self.coords(rank)}
        members = []
        for index in itertools.product(*(range(getattr(self, a)) for a in axes)):
            c.update(zip(axes, index, strict=True))
            members.append(self.rank_at(c["dp"], c["pp"], c["tp"], c["cp"]))
        key = (axis, min(members))
        if key not in self._groups:
            self._groups[key] = make_group(members, kind, self.world_size)
        return self._groups[key]

    def dp_group(self, rank: int | None = None) -> ProcessGroup:
        return self.group("dp", rank)

    def pp_group(self, rank: int | None = None) -> ProcessGroup:
        return self.group("pp", rank)

    def tp_group(self, rank: int | None = None) -> ProcessGroup:
        return self.group("tp", rank)

    def cp_group(self, rank: int | None = None) -> ProcessGroup:
        return self.group("cp", rank)

    def dp_cp_group(self, rank: int | None = None) -> ProcessGroup:
        """DP x CP: the ranks holding the same parameters (gradients averaged here)."""
        return self.group("dp-cp", rank)

    def ep_rank_of(self, rank: int | None = None) -> int:
        """My index in my expert-parallel group (which experts I hold)."""
        return self.coords(rank)["dp"] % self.ep

    def ep_group(self, rank: int | None = None) -> ProcessGroup:
        """The ep ranks of my DP group that hold different experts (kind "ep")."""
        return self._dp_subgroup("ep", rank)

    def expert_data_parallel_group(self, rank: int | None = None) -> ProcessGroup:
        """The dp / ep ranks of my DP group that hold my experts (kind "dp")."""
        return self._dp_subgroup("edp", rank)

    def _dp_subgroup(self, which: str, rank: int | None) -> ProcessGroup:
        members = list(self.dp_group(rank).ranks)
        i = self.coords(rank)["dp"]
        if which == "ep":
            start = i - i % self.ep
            members, kind = members[start:start + self.ep], "ep"
        else:
            members, kind = members[i % self.ep::self.ep], "dp"
        key = (which, members[0])
        if key not in self._groups:
            self._groups[key] = make_group(members, kind, self.world_size)
        return self._groups[key]

    def every_group(self) -> list[ProcessGroup]:
        """Every group of the mesh, in an order every rank agrees on: each axis's, the
        DP x CP ones, the expert groups, and the embedding groups (the first and last rank
        of each pipeline group, which hold a tied embedding's two copies): what Megatron's
        `parallel_state.initialize_model_parallel` creates on every rank up front, as
        torch.distributed's new_group asks."""
        groups = [g for axis in AXES + tuple(COMBINED) for g in self.all_groups(axis)]
        for which in ("ep", "edp"):
            groups += sorted({self._dp_subgroup(which, r) for r in range(self.world_size)},
                             key=lambda g: g.ranks)
        groups += [make_group((g.ranks[0], g.ranks[-1]), "pp", self.world_size)
                   for g in self.all_groups("pp") if g.size > 2]
        return groups

    def all_groups(self, axis: str) -> list[ProcessGroup]:
        """Every group along `axis`, ordered by first member."""
        unique = {self.group(axis, r) for r in range(self.world_size)}
        return sorted(unique, key=lambda g: g.ranks)

    def __repr__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return f"DeviceMesh(dp={self.dp}, pp={self.pp}{cp}, tp={self.tp})"
