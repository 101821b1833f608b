"""What a ZeRO-3 unit keeps between its forward and its backward: PyTorch FSDP2's
`reshard_after_forward` (torch/distributed/fsdp/_fully_shard/_fully_shard.py, the
argument's docstring; `FSDPParamGroup.reshard` and `_to_sharded_post_forward` in
_fsdp_param_group.py) and ZeRO++'s hierarchical partitioning, hpZ (Wang et al. 2023,
"ZeRO++: Extremely Efficient Collective Communication for Giant Model Training",
section 4.2; DeepSpeed's `zero_hpz_partition_size`, `_partition_param_sec` in
runtime/zero/partition_parameters.py).

ZeRO-3 all-gathers a unit's parameters for its forward and again for its backward, over
all N ranks of the data-parallel group: across nodes, the slow link, twice. The
choices, for Psi parameters of 2 bytes (bf16) per rank:

    True   ReshardAfterForward     free after forward; backward all-gathers over the N
                                   ranks again. Parameters between uses: 2Psi/N.
    False  KeepAfterForward        keep the full parameters until the unit's backward:
                                   no backward all-gather, up to 2Psi of gathered
                                   parameters at the end of forward (ZeRO-2's memory).
    K      ReshardToSecondary      after forward keep my 1/K piece of the full
                                   parameters (the "secondary partition"), so backward
                                   all-gathers over K ranks, a node's, never crossing
                                   nodes: + 2Psi/K per rank while the pieces live.

hpZ and FSDP2's integer are the same idea with two lifetimes: FSDP2 drops the piece after
the unit's backward (post-backward reshards to the full world), DeepSpeed keeps it until
the optimizer step (`invalidate_secondary_tensor` in stage3.py's `_post_step`), so with
gradient accumulation the later micro-batches' forwards gather within the node too.

A policy answers three questions for `Zero3Optimizer` (stage3.py): what to do with a
unit's gathered parameters after its forward, which shard to all-gather and over which
group, and what to drop after its backward and after the step.
"""

from __future__ import annotations

from minipar import distributed as dist


class ReshardAfterForward:
    """FSDP2's reshard_after_forward=True, ZeRO-3's own: free after forward, all-gather
    my shard over the whole sharding group whenever the unit is needed."""

    name = "true"

    def after_forward(self, engine, shards) -> None:
        engine.free(shards)

    def source(self, sb, group):
        """(the shard to all-gather, the group to gather it over) for one unit."""
        return sb.param_shard, group

    def after_backward(self, sb) -> None:
        """The unit's backward is over (its gathered parameters are freed already)."""

    def after_step(self, shards) -> None:
        """The parameters changed: drop whatever copies of the old ones remain."""


class KeepAfterForward(ReshardAfterForward):
    """FSDP2's reshard_after_forward=False: the full parameters stay gathered from the
    unit's forward to its backward, which then needs no all-gather; the unit's
    post-backward frees them (Zero3Optimizer frees a unit once its gradients are
    flattened)."""

    name = "false"

    def after_forward(self, engine, shards) -> None:
        pass


class ReshardToSecondary(ReshardAfterForward):
    """Reshard to a K-rank world after forward (FSDP2's reshard_after_forward=K; ZeRO++
    hpZ with keep_until_step). group: my secondary group (K consecutive ranks of the
    sharding group, a node's: `DeviceMesh.dp_subgroup("dp_secondary")`).

    After a unit's forward, I keep piece k of its full flat parameters (k: my index in
    the secondary group; (padded_numel / K,) elements, `sb.secondary`), taken from the
    gathered buffer without communication; the all-gather of the K pieces over the
    secondary group rebuilds the full parameters for backward."""

    def __init__(self, group, *, keep_until_step: bool = False):
        self.group, self.keep_until_step = group, keep_until_step
        self.name = str(group.size)

    def after_forward(self, engine, shards) -> None:
        k, K = dist.get_rank(self.group), self.group.size
        for sb in shards:
            # a second use in the same forward (a tied head) keeps the piece it has, as
            # DeepSpeed's `_partition_param_sec` returns early when it exists
            if sb.secondary is None and sb.gathered is not None:
                size = sb.bucket.padded_numel // K
                sb.secondary = sb.gathered[k * size:(k + 1) * size].copy()
        engine.free(shards)

    def source(self, sb, group):
        if sb.secondary is None:  # this step's first use: the primary shard, all N ranks
            return sb.param_shard, group
        return sb.secondary, self.group

    def after_backward(self, sb) -> None:
        if not self.keep_until_step:  # FSDP2: post-backward reshards to the full world
            sb.secondary = None

    def after_step(self, shards) -> None:
        for sb in shards:
            sb.secondary = None


def reshard_policy(reshard_after_forward: bool | int, secondary_group=None,
                   keep_until_step: bool = False) -> ReshardAfterForward:
    """The policy of a setting: True, False, or an int K (with the K-rank group)."""
    if reshard_after_forward is True:
        return ReshardAfterForward()
    if reshard_after_forward is False:
        return KeepAfterForward()
    if secondary_group is None or secondary_group.size != reshard_after_forward:
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} needs the "
                         f"{reshard_after_forward}-rank secondary group")
    return ReshardToSecondary(secondary_group, keep_until_step=keep_until_step)
