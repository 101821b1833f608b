"""DeviceMesh: Megatron/picotron layout (tp fastest), coordinates, groups, nodes."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist


def test_layout_matches_a_dp_pp_tp_grid():
    mesh = dist.DeviceMesh(dp=2, pp=3, tp=4)
    grid = np.arange(24).reshape(2, 3, 4)  # picotron: torch.arange(world).view(dp, pp, tp)
    for (d, p, t), rank in np.ndenumerate(grid):
        assert mesh.coords(int(rank)) == {"dp": d, "pp": p, "tp": t}
        assert mesh.rank_at(d, p, t) == rank
        assert mesh.tp_group(int(rank)).ranks == tuple(int(r) for r in grid[d, p, :])
        assert mesh.pp_group(int(rank)).ranks == tuple(int(r) for r in grid[d, :, t])
        assert mesh.dp_group(int(rank)).ranks == tuple(int(r) for r in grid[:, p, t])


def test_groups_of_a_2x2x2_mesh_and_their_kinds():
    mesh = dist.DeviceMesh(dp=2, pp=2, tp=2)
    assert [g.ranks for g in mesh.all_groups("tp")] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [g.ranks for g in mesh.all_groups("pp")] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [g.ranks for g in mesh.all_groups("dp")] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert {g.kind for g in mesh.all_groups("dp")} == {"dp"}
    assert mesh.tp_group(5).kind == "tp" and mesh.pp_group(5).kind == "pp"


def test_mesh_inside_a_launch_and_nodes():
    def worker():
        mesh = dist.DeviceMesh(dp=4, tp=4)
        return mesh.coords(), mesh.node(), mesh.tp_rank, dist.get_rank(mesh.dp_group())

    results = dist.launch(worker, 16, gpus_per_node=8)
    for rank, (coords, node, tp_rank, dp_index) in enumerate(results):
        assert coords == {"dp": rank // 4, "pp": 0, "tp": rank % 4}
        assert node == rank // 8 and tp_rank == rank % 4 and dp_index == rank // 4


def test_mesh_product_must_be_the_world_size():
    with pytest.raises(ValueError, match="dp=2 x pp=1 x tp=2 = 4 ranks, but the world has 8"):
        dist.launch(lambda: dist.DeviceMesh(dp=2, tp=2), 8)
    with pytest.raises(ValueError, match="every size must be an int >= 1"):
        dist.DeviceMesh(dp=0)
    with pytest.raises(ValueError, match="product is 6"):
        dist.DeviceMesh(dp=2, tp=2, world_size=6)


def test_groups_are_validated():
    with pytest.raises(ValueError, match=r"rank\(s\) \[4\] outside the world of 4 ranks"):
        dist.launch(lambda: dist.new_group([0, 4]), 4)
    with pytest.raises(ValueError, match="duplicates"):
        dist.launch(lambda: dist.new_group([1, 1]), 4)
    with pytest.raises(ValueError, match="group kind 'data'"):
        dist.launch(lambda: dist.new_group([0, 1], kind="data"), 4)
    group = dist.launch(lambda: dist.new_group([3, 1], kind="tp"), 4)[0]
    assert group.ranks == (1, 3) and group.group_rank(3) == 1 and 2 not in group


def test_cp_axis_sits_between_pp_and_tp_and_dp_cp_group_averages_gradients():
    mesh = dist.DeviceMesh(dp=2, pp=1, tp=2, cp=2, world_size=8)
    assert mesh.axes == ("dp", "pp", "cp", "tp") and mesh.shape == (2, 1, 2, 2)
    assert mesh.coords(6) == {"dp": 1, "pp": 0, "cp": 1, "tp": 0}
    assert [list(g.ranks) for g in mesh.all_groups("cp")] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [list(g.ranks) for g in mesh.all_groups("tp")] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(g.ranks) for g in mesh.all_groups("dp-cp")] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.group("cp", 0).kind == "cp" and mesh.group("dp-cp", 0).kind == "dp"
    for rank in range(8):
        assert mesh.rank_at(**mesh.coords(rank)) == rank
    assert dist.DeviceMesh(dp=2, world_size=2).coords(1) == {"dp": 1, "pp": 0, "tp": 0}


def test_data_parallel_sub_groups_for_sharding_across_nodes():
    """HSDP's shard / replicate groups, the secondary partition's, qgZ's node levels: each
    its own kind, made only when asked for, and in every_group (the torch engine's list)."""
    mesh = dist.DeviceMesh(dp=4, tp=2, world_size=8, gpus_per_node=4, dp_shard=2,
                           dp_secondary=1, dp_node_groups=True)

    def groups(kind):
        return sorted({mesh.dp_subgroup(kind, r).ranks for r in range(8)})

    assert groups("dp_shard") == [(0, 2), (1, 3), (4, 6), (5, 7)]  # inside the dp groups
    assert groups("dp_replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups("dp_intra_node") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups("dp_inter_node") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.dp_subgroup("dp_inter_node", 6).kind == "dp_inter_node"
    kinds = [g.kind for g in mesh.every_group()]
    assert kinds.count("dp_shard") == 4 and kinds.count("dp_secondary") == 8
    plain = dist.DeviceMesh(dp=4, tp=2, world_size=8, gpus_per_node=4)
    assert plain.dp_subgroup_kinds == () and len(plain.every_group()) == len(
        [g for g in mesh.every_group() if not g.kind.startswith("dp_")])
    with pytest.raises(ValueError, match="no dp_shard groups: build the mesh with dp_shard=K"):
        plain.dp_subgroup("dp_shard", 0)
    with pytest.raises(ValueError, match="dp_shard=3: must divide the 4 ranks"):
        dist.DeviceMesh(dp=4, world_size=4, dp_shard=3)
    with pytest.raises(ValueError, match=r"\[2, 4\] members on different nodes"):
        dist.DeviceMesh(dp=6, world_size=6, gpus_per_node=4, dp_node_groups=True)
