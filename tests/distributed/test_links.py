"""What a wire costs on the simulated clock: the slowest link a group crosses, and a
collective's ring time on it, asked of one `Links` by both engines' clusters."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.distributed.clock import DeviceProfile, collective_time
from minipar.distributed.links import REMEMBERED, Links

PROFILE = DeviceProfile(intra_node_latency=3e-6, inter_node_latency=8e-6,
                        intra_node_bandwidth=400e9, inter_node_bandwidth=50e9)


def test_a_group_inside_a_node_uses_nvlink_and_one_across_nodes_the_network():
    links = Links(gpus_per_node=4, profile=PROFILE)
    assert links.link((0, 3)) == (3e-6, 400e9)
    assert links.link((3, 4)) == (8e-6, 50e9)
    assert links.link((0, 1, 2, 3, 4)) == (8e-6, 50e9)  # the slowest link sets a ring


def test_a_ring_across_nodes_pays_the_network_only_between_nodes():
    # 8 ranks on 2 nodes of 4: NCCL's ring crosses the network twice a pass
    links = Links(gpus_per_node=4, profile=PROFILE)
    ranks, nbytes = tuple(range(8)), 1 << 20
    seconds = links.collective_seconds("all_reduce", ranks, nbytes)
    assert seconds == collective_time("all_reduce", 8, nbytes, 8e-6, 50e9, 2, 3e-6)
    one_node = Links(gpus_per_node=8, profile=PROFILE)
    assert one_node.collective_seconds("all_reduce", ranks, nbytes) < seconds


def test_an_answer_asked_again_is_the_same_past_what_is_remembered():
    links = Links(gpus_per_node=2, profile=PROFILE)
    first = [links.collective_seconds("all_gather", (0, 1, 2), n) for n in range(REMEMBERED + 8)]
    again = [links.collective_seconds("all_gather", (0, 1, 2), n) for n in range(REMEMBERED + 8)]
    assert first == again
    assert again[-1] == collective_time("all_gather", 3, REMEMBERED + 7, 8e-6, 50e9, 2, 3e-6)


def test_a_launched_collective_takes_the_time_links_prices():
    def worker():
        before = dist.get_device().clock.now
        dist.all_reduce(np.zeros(1024, np.float64))
        return dist.get_device().clock.now - before

    took = dist.launch(worker, 4, gpus_per_node=2, device=PROFILE)
    priced = Links(2, PROFILE).collective_seconds("all_reduce", (0, 1, 2, 3), 1024 * 8)
    assert took == [pytest.approx(priced, rel=1e-12)] * 4
