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

Sharding across nodes cuts the data-parallel group (dp, or dp x cp) into sub-groups, made
only when asked for (each its own kind, so the byte ledger shows their traffic apart):

    dp_shard=K      HSDP / MiCS (PyTorch FSDP2's 2-D mesh (replicate, shard), DeepSpeed's
                    `mics_shard_size`): "dp_shard" groups of K consecutive members shard
                    the model; "dp_replicate" groups, the members at the same place of
                    every shard group, hold the same shard
    dp_secondary=K  ZeRO++ hpZ's secondary partition (DeepSpeed's
                    `_create_zero_param_parallel_group`: K consecutive ranks) and FSDP2's
                    `reshard_after_forward=K`: "dp_secondary" groups of K consecutive
                    members of the sharding group (the shard group with HSDP)
    dp_node_groups  ZeRO++ qgZ's two levels (DeepSpeed's `local_{i}` and `global_{j}`
                    all-to-all groups): "dp_intra_node", the members on my node, and
                    "dp_inter_node", the members at my place on every node

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
# The sub-groups of the data-parallel group (the module docstring), each its own kind.
DP_SUBGROUPS = ("dp_shard", "dp_replicate", "dp_secondary", "dp_intra_node", "dp_inter_node")


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
        dp_shard: int | None = None,
        dp_secondary: int | None = None,
        dp_node_groups: bool = False,
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
        replicas = dp * cp
        for name, n, within in (("dp_shard", dp_shard, replicas),
                                ("dp_secondary", dp_secondary, dp_shard or replicas)):
            if n is not None and (not isinstance(n, int) or n < 1 or within % n):
                raise ValueError(f"DeviceMesh {name}={n!r}: must divide the {within} ranks "
                                 "it cuts into groups")
        self.dp_shard, self.dp_secondary = dp_shard, dp_secondary
        self.dp_node_groups = dp_node_groups
        self._groups: dict[tuple[str, int], ProcessGroup] = {}
        if dp_node_groups:
            per_node = {len(ranks) for r in range(size)
                        for ranks in self.data_parallel_ranks_by_node(r)}
            if len(per_node) > 1:
                raise ValueError(f"DeviceMesh dp_node_groups: the data-parallel groups have "
                                 f"{sorted(per_node)} members on different nodes; the two "
                                 "levels need the same number on every node")
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

    # --- sharding across nodes: sub-groups of the data-parallel group -----------------------
    def data_parallel_group(self, rank: int | None = None) -> ProcessGroup:
        """The ranks holding the same parameters: DP, or DP x CP with context parallelism."""
        return self.group("dp-cp" if self.cp > 1 else "dp", rank)

    def data_parallel_ranks_by_node(self, rank: int | None = None) -> list[list[int]]:
        """The members of my data-parallel group, node by node (nodes in order)."""
        by_node: dict[int, list[int]] = {}
        for member in self.data_parallel_group(rank).ranks:
            by_node.setdefault(member // self.gpus_per_node, []).append(member)
        return list(by_node.values())

    def dp_subgroup(self, kind: str, rank: int | None = None) -> ProcessGroup:
        """My group of one of the DP_SUBGROUPS kinds (the module docstring); the mesh must
        have been built with its size (dp_shard, dp_secondary) or dp_node_groups."""
        if kind not in DP_SUBGROUPS:
            raise ValueError(f"{kind!r} is not one of {DP_SUBGROUPS}")
        needs = {"dp_shard": self.dp_shard, "dp_replicate": self.dp_shard,
                 "dp_secondary": self.dp_secondary, "dp_intra_node": self.dp_node_groups,
                 "dp_inter_node": self.dp_node_groups}[kind]
        if not needs:
            raise ValueError(f"DeviceMesh: no {kind} groups: build the mesh with "
                             + ("dp_node_groups=True" if "node" in kind else
                                "dp_secondary=K" if kind == "dp_secondary" else "dp_shard=K"))
        me = self._rank(rank)
        members = list(self.data_parallel_group(me).ranks)
        if kind in ("dp_shard", "dp_replicate", "dp_secondary"):
            if kind == "dp_secondary" and self.dp_shard:
                members = list(self.dp_subgroup("dp_shard", me).ranks)
            size = self.dp_secondary if kind == "dp_secondary" else self.dp_shard
            i = members.index(me)
            chosen = members[i % size::size] if kind == "dp_replicate" else \
                members[i - i % size:i - i % size + size]
        else:
            by_node = self.data_parallel_ranks_by_node(me)
            mine = next(ranks for ranks in by_node if me in ranks)
            chosen = mine if kind == "dp_intra_node" else \
                [ranks[mine.index(me)] for ranks in by_node]
        key = (kind, min(chosen))
        if key not in self._groups:
            self._groups[key] = make_group(chosen, kind, self.world_size)
        return self._groups[key]

    def every_group(self) -> list[ProcessGroup]:
        """Every group of the mesh, in an order every rank agrees on: each axis's, the
        DP x CP ones, the expert groups, the embedding groups (the first and last rank
        of each pipeline group, which hold a tied embedding's two copies), and the DP
        sub-groups the mesh was built with: what Megatron's
        `parallel_state.initialize_model_parallel` creates on every rank up front, as
        torch.distributed's new_group asks."""
        groups = [g for axis in AXES + tuple(COMBINED) for g in self.all_groups(axis)]
        for which in ("ep", "edp"):
            groups += sorted({self._dp_subgroup(which, r) for r in range(self.world_size)},
                             key=lambda g: g.ranks)
        groups += [make_group((g.ranks[0], g.ranks[-1]), "pp", self.world_size)
                   for g in self.all_groups("pp") if g.size > 2]
        for kind in self.dp_subgroup_kinds:
            groups += sorted({self.dp_subgroup(kind, r) for r in range(self.world_size)},
                             key=lambda g: g.ranks)
        return groups

    @property
    def dp_subgroup_kinds(self) -> tuple[str, ...]:
        """The DP sub-group kinds this mesh was built with."""
        return (("dp_shard", "dp_replicate") * bool(self.dp_shard)
                + ("dp_secondary",) * bool(self.dp_secondary)
                + ("dp_intra_node", "dp_inter_node") * self.dp_node_groups)

    def all_groups(self, axis: str) -> list[ProcessGroup]:
        """Every group along `axis`, ordered by first member."""
        unique = {self.group(axis, r) for r in range(self.world_size)}
        return sorted(unique, key=lambda g: g.ranks)

    def __repr__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return f"DeviceMesh(dp={self.dp}, pp={self.pp}{cp}, tp={self.tp})"
