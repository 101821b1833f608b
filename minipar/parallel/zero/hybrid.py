"""Hybrid sharding: ZeRO-3 inside a group of K ranks, replication across the groups.
PyTorch FSDP2's HSDP (`fully_shard(mesh=2-D (replicate, shard) mesh)`;
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`: the
reduce-scatter over the shard group, then the all-reduce over the replicate group) and
DeepSpeed's MiCS (Zhang et al. 2022, "MiCS: Near-linear Scaling for Training Gigantic
Model on Public Cloud"; runtime/zero/mics.py, `mics_shard_size`).

ZeRO-3 over all N ranks of the data-parallel group all-gathers every parameter twice
and reduce-scatters every gradient once per step across every node. With the N ranks cut
into N/K shard groups of K (a node's), each shard group runs ZeRO-3 on its own (the
all-gathers and reduce-scatters stay inside the node), and the shard groups hold the
same shards: ranks at the same place of every shard group form a replicate group that
all-reduces its gradient shard once per step, the only traffic across nodes.

    my shard group:      K ranks, ZeRO-3 among them     params, grads, optimizer: 16Psi/K
    my replicate group:  N/K ranks holding my shard     all-reduce of my gradient shard

One step, from rank r's point of view:

    forward / backward   as ZeRO-3 over the shard group (stage3.py)
    gradients            reduce-scatter over the shard group (every micro-batch) ->
                         my shard of the shard group's average; at the accumulation
                         boundary, all-reduce it over the replicate group (MiCS's
                         `allreduce_mics_shard_grads`, FSDP2 with
                         `set_requires_all_reduce(False)` until the last micro-batch)
                         -> my shard of the average over all N ranks
    step                 AdamW on my shard, the same in every replica of it

Model state per rank is ZeRO-3's over K instead of N: 16Psi/K, more memory than ZeRO-3
over the N ranks and less than DDP. Elements a rank sends per step (one micro-batch, R =
N/K replicas): the shard group's 3(K-1)/K Psi inside the node and the replicate
all-reduce's 2(R-1)/R x Psi/K across nodes, where ZeRO-3's rings over all N ranks carry
3(N-1)/N Psi through every node boundary they cross.

Where minipar differs: DeepSpeed's MiCS can also all-gather hierarchically
(`mics_hierarchical_params_gather`), and FSDP2 all-reduces after every backward unless told
not to; minipar all-reduces once per step.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.parallel.zero.partition import ShardedBucket
from minipar.parallel.zero.stage3 import Zero3Optimizer


class HybridShardedOptimizer(Zero3Optimizer):
    """ZeRO-3 over `shard_group`, replicated over `replicate_group` (HSDP / MiCS); the
    other arguments are `Zero3Optimizer`'s."""

    def __init__(self, named_params, shard_group, replicate_group, **zero3):
        self.replicate_group = replicate_group
        super().__init__(named_params, shard_group, **zero3)

    def _complete(self, sb: ShardedBucket, flat: np.ndarray, work) -> None:
        """After the shard group's reduce-scatter, at the accumulation boundary, average
        my gradient shard over the replicas of it."""
        super()._complete(sb, flat, work)
        if self.require_backward_grad_sync:
            sb.grad_shard = dist.all_reduce(sb.grad_shard, op="avg",
                                            group=self.replicate_group)
