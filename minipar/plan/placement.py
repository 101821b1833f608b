"""Which pipeline ranks share a node, under a layout's rank order.

A layout (plan/layout.py's ParallelConfig) places its world ranks by `rank_at`: in
minipar's order a replica (one dp index) is pp x cp x tp consecutive ranks, a stage tp x
cp of them; in Megatron-LM's default pp is slowest and a stage is dp x cp x tp
consecutive ranks. A pipeline message between two stages crosses nodes when its two
ranks lie on different nodes, which can differ from replica to replica when a replica
does not divide a node. The functions take the layout as `config` (its pp, dp, cp, tp,
schedule, virtual_stages and rank_at).
"""

from __future__ import annotations

import collections
import functools
import itertools

from minipar.parallel.pipeline.placements import PLACEMENTS
from minipar.parallel.pipeline.schedules.registry import SCHEDULES


def replica_hops_crossing(config, gpus_per_node: int
                          ) -> tuple[frozenset[tuple[int, int]], ...]:
    """The (sender, receiver) pipeline ranks whose messages leave a node, one set for each
    distinct pattern among the replicas (the pipelines of pp x cp x tp ranks, one per dp
    index). A hop of a replica crosses if it does on any of its tp x cp ranks. In
    minipar's rank order a stage is tp x cp consecutive ranks in each replica's block, so
    while tp x cp is below a node, stages share nodes and only some hops cross; in
    Megatron-LM's (pp slowest) a stage is dp x cp x tp consecutive ranks and every hop
    crosses once that fills a node. Replicas that straddle nodes (dp 3 x pp 3 on 8-GPU
    nodes: ranks 6, 7 | 8) cross on different hops. A replica's ranks are replica 0's
    moved by d times a fixed stride, so only that shift modulo a node tells replicas
    apart: the first gpus_per_node replicas show every pattern."""
    # A search asks for thousands of layouts that differ in batch, ZeRO or recomputation
    # only: the answer depends on the sizes and the order, worked out once for each.
    key = (config.pp, config.dp, config.cp, config.tp, config.rank_order, gpus_per_node)
    if key not in _HOPS:
        _HOPS[key] = _replica_hops_crossing(config, gpus_per_node)
    return _HOPS[key]


_HOPS: dict[tuple, tuple[frozenset[tuple[int, int]], ...]] = {}


def _replica_hops_crossing(config, gpus_per_node: int
                           ) -> tuple[frozenset[tuple[int, int]], ...]:
    p, gpn = config.pp, gpus_per_node
    patterns: list[frozenset[tuple[int, int]]] = []
    for d in range(min(config.dp, gpn)):
        hops = frozenset(
            (sender, receiver) for sender in range(p)
            for receiver in {(sender - 1) % p, (sender + 1) % p} - {sender}
            if any(config.rank_at(d, sender, c, t) // gpn
                   != config.rank_at(d, receiver, c, t) // gpn
                   for c in range(config.cp) for t in range(config.tp)))
        if hops not in patterns:
            patterns.append(hops)
    return tuple(patterns)


@functools.lru_cache(maxsize=32)  # (every stage of a deep pipeline asks: O(p) each)
def stage_holders(placement: str, p: int, v: int) -> tuple[int, ...]:
    """The pipeline rank that holds each of the p v virtual stages."""
    holder = [0] * (p * v)
    for r in range(p):
        for c in range(v):
            holder[PLACEMENTS[placement](p, r, c)] = r
    return tuple(holder)


def busiest_pipeline_rank(config, gpus_per_node: int) -> int:
    """The pipeline rank with the most messages between virtual stages that cross nodes,
    in its busiest replica (the lowest such rank; rank 0 when none cross)."""
    holder = stage_holders(SCHEDULES[config.schedule].placement, config.pp,
                           config.virtual_stages)
    boundaries = [hop for hop in itertools.pairwise(holder) if hop[0] != hop[1]]
    crossing = [0] * config.pp
    for hops in replica_hops_crossing(config, gpus_per_node):
        counts = collections.Counter(r for hop in boundaries if hop in hops for r in hop)
        crossing = [max(crossing[r], counts[r]) for r in range(config.pp)]
    return crossing.index(max(crossing))
