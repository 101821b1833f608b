"""ClusterSpec, ring bytes per rank, and which mesh groups cross node boundaries."""

from __future__ import annotations

import itertools

import pytest

from minipar.distributed import DeviceMesh, DeviceProfile, all_reduce_bytes
from minipar.plan.cluster import (
    GIB,
    ClusterSpec,
    all_gather_sent,
    all_reduce_sent,
    broadcast_sent,
    group_crosses_nodes,
    group_rails,
    rails,
    reduce_scatter_sent,
)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 64, 1000, 1001])
def test_all_reduce_bytes_are_the_ring_algorithms(n, numel):
    itemsize = 4
    sent = [all_reduce_sent(numel, itemsize, n, i) for i in range(n)]
    # Summed over the ring every element travels 2(n - 1) times (Patarasuk & Yuan 2009).
    assert sum(sent) == 2 * (n - 1) * numel * itemsize
    if numel % n == 0:
        assert set(sent) == {2 * (n - 1) * numel * itemsize // n}
    # ... and the emulator books the same per position.
    assert sent == [all_reduce_bytes(numel, itemsize, n, i)[0] for i in range(n)]


def test_other_collectives_send_n_minus_one_pieces():
    assert all_gather_sent(10, 2, 4) == 3 * 10 * 2
    assert reduce_scatter_sent(40, 2, 4) == 3 * 10 * 2
    assert all_gather_sent(10, 2, 1) == reduce_scatter_sent(40, 2, 1) == 0
    assert [broadcast_sent(8, 3, k) for k in range(3)] == [8, 8, 0]


def crosses_by_enumeration(dp, pp, tp, gpus_per_node, axis):
    mesh = DeviceMesh(dp=dp, pp=pp, tp=tp, gpus_per_node=gpus_per_node)
    return any(len({r // gpus_per_node for r in group.ranks}) > 1
               for group in mesh.all_groups(axis))


@pytest.mark.parametrize("dp,pp,tp,gpn", [
    (d, p, t, g) for d, p, t, g in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3, 4, 8),
                                                      (4, 6, 8))])
def test_group_placement_matches_the_device_mesh(dp, pp, tp, gpn):
    world = dp * pp * tp
    assert group_crosses_nodes(tp, 1, world, gpn) == crosses_by_enumeration(dp, pp, tp, gpn,
                                                                            "tp")
    assert group_crosses_nodes(pp, tp, world, gpn) == crosses_by_enumeration(dp, pp, tp, gpn,
                                                                             "pp")
    assert group_crosses_nodes(dp, pp * tp, world, gpn) == crosses_by_enumeration(
        dp, pp, tp, gpn, "dp")


def rails_by_enumeration(groups, gpus_per_node) -> int:
    crossing = [g.ranks for g in groups if len({r // gpus_per_node for r in g.ranks}) > 1]
    return min((sum(r // gpus_per_node == node for r in ranks)
                for ranks in crossing for node in {r // gpus_per_node for r in ranks}),
               default=0)


@pytest.mark.parametrize("dp,pp,cp,tp,gpn", [
    (d, p, c, t, g) for d, p, c, t, g in itertools.product((1, 2, 3, 4), (1, 2), (1, 2),
                                                            (1, 2, 4), (2, 4, 6, 8))])
def test_group_rails_are_the_fewest_members_a_crossing_group_has_on_a_node(dp, pp, cp, tp,
                                                                           gpn):
    mesh = DeviceMesh(dp=dp, pp=pp, tp=tp, cp=cp, gpus_per_node=gpn)
    world = mesh.world_size
    assert group_rails(tp, 1, world, gpn) == rails_by_enumeration(mesh.all_groups("tp"), gpn)
    assert group_rails(pp, tp * cp, world, gpn) == rails_by_enumeration(
        mesh.all_groups("pp"), gpn)
    dp_cp = {mesh.dp_cp_group(r) for r in range(world)}
    assert group_rails(dp, tp * cp * pp, world, gpn, inner=cp, inner_stride=tp) == \
        rails_by_enumeration(dp_cp, gpn)


def test_a_ring_across_nodes_runs_on_a_nic_per_member_a_node_up_to_nvlink():
    # NCCL's channels: each crosses between nodes through another GPU's NIC
    h100 = ClusterSpec(name="h100", gpus_per_node=8, memory_bytes=GIB, peak_flops=1e15,
                       efficiency=0.5, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9)
    gib = 2**30
    one, four, eight = (h100.collective_time("all_reduce", 16, gib, m) for m in (1, 4, 8))
    inside = h100.collective_time("all_reduce", 16, gib, 0)

    def latency(per_node):  # 2 (nodes - 1) network steps, the rest of 2 x 15 over NVLink
        inter = 2 * (16 // per_node - 1)
        return inter * h100.inter_node_latency + (30 - inter) * h100.intra_node_latency

    assert (one - latency(1)) / (four - latency(4)) == pytest.approx(4)
    assert (one - latency(1)) / (eight - latency(8)) == pytest.approx(8)
    assert inside < eight  # 8 NICs are 400 GB/s, NVLink 450
    # pairwise traffic leaves on each GPU's own NIC: a send and an all-to-all get one
    assert h100.collective_time("all_to_all", 16, gib, 8) == h100.collective_time(
        "all_to_all", 16, gib, 1)
    # the emulator runs one ring: its cluster crosses nodes on one NIC
    emulated = ClusterSpec.from_device_profile(DeviceProfile(), gpus_per_node=8)
    assert not emulated.nic_rails
    # (the bandwidth of one NIC whatever the members a node; only the latency differs)
    assert emulated.collective_time("all_reduce", 16, gib, 8) - emulated.collective_time(
        "all_reduce", 16, gib, 1) == pytest.approx(-28 * (8e-6 - 3e-6))
    assert rails([0, 1, 8, 9, 10], 8) == 2 and rails([0, 8], 8) == 1 and rails([0, 1], 8) == 0


def test_emulated_cluster_is_the_device_profile():
    profile = DeviceProfile()
    spec = ClusterSpec.from_device_profile(profile, gpus_per_node=4, memory_bytes=GIB)
    assert spec.sustained_flops == profile.flops
    assert spec.link(False) == profile.link(True)
    assert spec.link(True) == profile.link(False)
    assert spec.usable_memory == GIB


def test_bad_cluster_settings_are_named():
    good = dict(name="x", gpus_per_node=8, memory_bytes=GIB, peak_flops=1e12, efficiency=0.5,
                intra_node_bandwidth=1e9, inter_node_bandwidth=1e9)
    with pytest.raises(ValueError, match="efficiency"):
        ClusterSpec(**{**good, "efficiency": 1.5})
    with pytest.raises(ValueError, match="gpus_per_node"):
        ClusterSpec(**{**good, "gpus_per_node": 0})
    with pytest.raises(ValueError, match="peak_flops"):
        ClusterSpec(**{**good, "peak_flops": 0})


def test_ring_chunks_are_numpy_s_array_split():
    import numpy as np

    from minipar.plan.cluster import all_reduce_sent, ring_chunk

    for numel in (0, 1, 5, 17, 1000, 12345):
        for n in (1, 2, 3, 7, 16):
            chunks = [len(c) for c in np.array_split(np.arange(numel), n)]
            assert [ring_chunk(numel, n, i) for i in range(n)] == chunks
            for position in range(n):
                once = chunks[(position + 1) % n] + chunks[(position + 2) % n]
                assert all_reduce_sent(numel, 2, n, position) == (
                    0 if n == 1 else 2 * (2 * numel - once))


def test_a_ring_pays_the_networks_latency_only_on_its_steps_between_nodes():
    # NCCL lays a node's members side by side on the ring (src/graph/tuning.cc counts
    # nInterSteps = nNodes - 1, 2 (nNodes - 1) for an all-reduce): 16 ranks on 2 nodes
    # of 8 cross the network on 1 step of an all-gather's 15, on 2 of an all-reduce's 30
    h100 = ClusterSpec(name="h100", gpus_per_node=8, memory_bytes=GIB, peak_flops=1e15,
                       efficiency=0.5, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
                       intra_node_latency=3e-6, inter_node_latency=8e-6)
    assert h100.collective_time("all_gather", 16, 0, 8) == pytest.approx(8e-6 + 14 * 3e-6)
    assert h100.collective_time("reduce_scatter", 16, 0, 8) == pytest.approx(50e-6)
    assert h100.collective_time("all_reduce", 16, 0, 8) == pytest.approx(2 * 8e-6 + 28 * 3e-6)
    # one member a node: every step crosses; 4 a node: 3 of 15
    assert h100.collective_time("all_gather", 16, 0, 1) == pytest.approx(15 * 8e-6)
    assert h100.collective_time("all_gather", 16, 0, 4) == pytest.approx(3 * 8e-6 + 12 * 3e-6)
    # inside a node, NVLink's alone; an all-to-all is pairwise, each exchange the network's
    assert h100.collective_time("all_gather", 8, 0, 0) == pytest.approx(7 * 3e-6)
    assert h100.collective_time("all_to_all", 16, 0, 8) == pytest.approx(15 * 8e-6)
