"""Which pipeline ranks share a node: each replica's hops that cross, and the rank the
planner must estimate because its messages cross most."""

from __future__ import annotations

import itertools

import pytest

from minipar.plan import presets
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import MEGATRON_ORDER, ParallelConfig, stage_plans
from minipar.plan.placement import busiest_pipeline_rank, replica_hops_crossing


def both_ways(*pairs) -> frozenset:
    """Hops (a, b), each with its way back (b, a)."""
    return frozenset(pairs) | {(b, a) for a, b in pairs}


def every_replicas_hops(config: ParallelConfig, gpus_per_node: int) -> set[frozenset]:
    """Brute force: each replica's crossing hops, from the node of every one of its ranks
    (including the wrap from the last stage to the first, which V schedules use)."""
    found = set()
    p = config.pp
    for d in range(config.dp):
        found.add(frozenset(
            (s, r) for s in range(p) for r in {(s - 1) % p, (s + 1) % p} - {s}
            if any(config.rank_at(d, s, c, t) // gpus_per_node
                   != config.rank_at(d, r, c, t) // gpus_per_node
                   for c in range(config.cp) for t in range(config.tp))))
    return found


@pytest.mark.parametrize("order", ["tp-cp-ep-pp-dp", MEGATRON_ORDER])
def test_every_replicas_pattern_is_found(order):
    """Only the first gpus_per_node replicas are looked at: a replica's ranks are the
    first one's shifted by a fixed stride, so its pattern repeats with that shift modulo
    a node."""
    some = 0
    for dp, pp, tp, cp, gpus_per_node in itertools.product(
            (1, 2, 3, 5, 9), (2, 3, 4, 8), (1, 2, 4), (1, 2), (2, 4, 6, 8, 16)):
        config = ParallelConfig(dp=dp, pp=pp, tp=tp, cp=cp, rank_order=order,
                                micro_batch_size=1, global_batch_size=dp * pp)
        patterns = replica_hops_crossing(config, gpus_per_node)
        assert set(patterns) == every_replicas_hops(config, gpus_per_node), config
        some += len(patterns) > 1
    assert some  # replicas that cross on different hops


def test_minipars_stages_share_nodes_where_megatrons_do_not():
    # tp 2 x pp 4 x dp 2 on 8-GPU nodes: minipar's stages are 2 consecutive ranks, so a
    # replica's 4 stages fill one node and no message leaves it; Megatron-LM's are 4
    # (dp x tp), two stages a node, and the hop between stages 1 and 2 crosses
    minipars = ParallelConfig(dp=2, pp=4, tp=2, grad_accum_steps=4)
    assert replica_hops_crossing(minipars, 8) == (frozenset(),)
    megatrons = minipars.replace(rank_order="tp-cp-ep-dp-pp")
    assert replica_hops_crossing(megatrons, 8) == (both_ways((1, 2), (3, 0)),)



def test_replicas_that_straddle_nodes_cross_on_their_own_hops():
    # dp 3 x pp 3 on 8-GPU nodes: replicas 0 and 1 (ranks 0-5) stay inside node 0,
    # replica 2 is ranks 6, 7 | 8
    config = ParallelConfig(dp=3, pp=3, micro_batch_size=1, global_batch_size=9)
    assert replica_hops_crossing(config, 8) == (frozenset(), both_ways((1, 2), (2, 0)))
    # dp 2 x pp 3 on 2-GPU nodes: ranks 0 1 | 2 3 | 4 5, replica 0 crosses on its last hop,
    # replica 1 on its first
    config = ParallelConfig(dp=2, pp=3, micro_batch_size=1, global_batch_size=6)
    assert set(replica_hops_crossing(config, 2)) == {both_ways((1, 2), (2, 0)),
                                                     both_ways((0, 1), (2, 0))}


def test_the_default_estimate_includes_the_rank_whose_messages_cross_most():
    """pp 8 on 4-GPU nodes: only the hop between ranks 3 and 4 crosses, and neither is
    one of the ranks that bound memory (first, second, last); the plan's pp time and
    exposed communication are those of every rank's estimate."""
    shape = presets.model("llama2-7b")
    config = ParallelConfig(pp=8, grad_accum_steps=16, micro_batch_size=1)
    assert busiest_pipeline_rank(config, 4) == 3
    assert [plan.rank for plan in stage_plans(shape, config, gpus_per_node=4)] == [0, 1, 3, 7]
    cluster = ClusterSpec.from_device_profile(gpus_per_node=4)
    default, every = estimate(shape, config, cluster), estimate(shape, config, cluster,
                                                                 all_stages=True)
    assert default.comm_time_by_group() == every.comm_time_by_group()
    assert default.time["exposed_comm_s"] == every.time["exposed_comm_s"]
    assert every.comm_time_by_group()["pp"] > 4 * estimate(
        shape, config, ClusterSpec.from_device_profile(gpus_per_node=8)).comm_time_by_group()[
        "pp"]
