"""ZeRO++'s quantized collectives (Wang et al. 2023, "ZeRO++: Extremely Efficient
Collective Communication for Giant Model Training"): the same results as ZeRO-3's
all-gather and reduce-scatter, up to rounding chosen on purpose, for fewer bytes.

qwZ, quantized weights (section 4.1; DeepSpeed's `zero_quantized_weights`,
`all_gather_coalesced(quantize=True)` in runtime/zero/partition_parameters.py): every
rank quantizes its bf16 shard to int8 in blocks (quantize.py) and the all-gather carries
the int8 values and each block's fp32 scale, then every rank dequantizes the n pieces:
half the bytes of a bf16 all-gather. DeepSpeed quantizes every parameter all-gather when
the switch is on (forward, backward, and a secondary partition's, `partitioned_param_coordinator.py`
`__all_gather_params(quantize=self.zero_quantized_weights)`): so does minipar.

    gathered = QuantizedAllGather()(shard, group=dp)          # (n * shard,) like all_gather

qgZ, quantized gradients (section 4.3; `zero_quantized_gradients`,
`all_to_all_quant_reduce` in runtime/comm/coalesced_collectives.py): the reduce-scatter
of ZeRO-3's gradients as two all-to-alls of int4 values, one inside each node and one
across nodes, with a reduction in between, so what crosses nodes is already a node's sum:

    rank (node q, local l) of N = Q nodes x L ranks; shard j of the flat gradient is
    rank j's, j = q * L + l (the DP group's ring order)
    1. quantize, by destination: to local rank l' go the Q shards q' * L + l' (the
       "tensor slice reordering" of section 4.3.2, DeepSpeed's `swizzle_quant`)
    2. all-to-all inside the node ("dp_intra_node")
    3. dequantize the L pieces, add them: the node's sum of my Q shards; quantize again
    4. all-to-all across nodes ("dp_inter_node"): shard q' * L + l goes to node q'
    5. dequantize the Q pieces of my shard, add them, divide by N for the average

Bytes a rank sends, for a flat gradient of G bf16 bytes (int4: G/4, and the scales):
(L-1)/L x G/4 inside its node, (Q-1)/Q x G/(4L) across nodes, where ZeRO-3's ring
reduce-scatter puts (N-1)/N x G on the ring, whose node boundaries it crosses.

    shard = AllToAllQuantReduce(intra, inter)(flat, op="avg", group=dp)   # as reduce_scatter

Where minipar differs: each all-to-all blocks (no overlap with backward); the sum of
step 3 and the division of step 5 run in fp64; DeepSpeed adds a node's pieces and then
divides by the number of nodes, minipar divides by N; with one node (Q = 1) DeepSpeed
falls back to its reduce-scatter, and so does minipar. The quantize and dequantize
kernels are not priced on the clock.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.parallel.zero.quantize import GRADIENT_BLOCK, WEIGHT_BLOCK, dequantize, quantize


class QuantizedAllGather:
    """qwZ: `dist.all_gather`'s signature (a flat (n,) shard, concatenated in group
    order), carrying int8 blocks of `block` elements and their fp32 scales."""

    bits = 8

    def __init__(self, block: int = WEIGHT_BLOCK):
        self.block = block

    def __call__(self, shard: np.ndarray, group=None, async_op: bool = False, out=None):
        q, scales = quantize(shard, self.bits, self.block)
        work = Dequantized(dist.all_gather(q, group=group, async_op=True),
                           dist.all_gather(scales, group=group, async_op=True),
                           self, shard, out)
        return work if async_op else work.wait()


class Dequantized:
    """The work of a quantized all-gather: wait() waits for the values and the scales
    and dequantizes every rank's piece (into `out`, the caller's buffer, if given)."""

    def __init__(self, values_work, scales_work, gather: QuantizedAllGather, shard, out):
        self.values_work, self.scales_work = values_work, scales_work
        self.gather, self.numel, self.dtype, self.out = gather, shard.size, shard.dtype, out

    def wait(self) -> np.ndarray:
        g, n = self.gather, self.numel
        with dist.transient(self.values_work.wait()) as values, \
                dist.transient(self.scales_work.wait()) as scales:
            ranks = len(values) // n
            blocks = len(scales) // ranks
            full = np.concatenate([
                dequantize(values[i * n:(i + 1) * n], scales[i * blocks:(i + 1) * blocks],
                           g.bits, g.block, n, self.dtype) for i in range(ranks)])
        if self.out is None:
            return full
        self.out[...] = full
        return self.out


class AllToAllQuantReduce:
    """qgZ: `dist.reduce_scatter`'s signature for a flat (N * S,) gradient (rank j gets
    shard j, (S,)), run as the hierarchical all-to-all of int4 blocks of the module
    docstring. intra, inter: my "dp_intra_node" and "dp_inter_node" groups
    (`DeviceMesh.dp_subgroup`)."""

    bits = 4

    def __init__(self, intra, inter, block: int = GRADIENT_BLOCK):
        self.intra, self.inter, self.block = intra, inter, block

    def __call__(self, flat: np.ndarray, op: str = "avg", group=None, async_op: bool = False):
        L, Q = self.intra.size, self.inter.size
        if Q == 1:  # one node: DeepSpeed's reduce-scatter (`num_nodes > 1` in stage3.py)
            return dist.reduce_scatter(flat, op=op, group=group, async_op=async_op)
        if op not in ("sum", "avg") or L * Q != group.size:
            raise ValueError(f"qgZ: op {op!r} over {group.size} ranks in {Q} nodes of {L}")
        me = dist.get_rank()
        if group.group_rank(me) != self.inter.group_rank(me) * L + self.intra.group_rank(me):
            raise ValueError(f"qgZ: {group} is not {Q} nodes of {L} consecutive ranks")
        S = flat.size // group.size
        shards = flat.reshape(Q, L, S)  # shard q * L + l
        # 1-2. by destination l': the Q shards q' * L + l'; all-to-all inside the node
        node_sums = self._all_to_all_sum(shards.transpose(1, 0, 2), self.intra)  # (Q, S)
        # 3-5. the node's sums, quantized again; shard q' * L + l to node q'
        mine = self._all_to_all_sum(node_sums[:, None, :], self.inter)[0]  # (S,)
        if op == "avg":
            mine /= group.size
        result = mine.astype(flat.dtype)
        return dist.CollectiveWork.completed(result) if async_op else result

    def _all_to_all_sum(self, chunks: np.ndarray, group) -> np.ndarray:
        """chunks (n, k, S): chunk i goes to group rank i, as k shards quantized apart.
        Returns (k, S) fp64: the sum over the n ranks of the chunks sent to me."""
        n, k, S = chunks.shape
        pieces = [quantize(shard, self.bits, self.block) for shard in chunks.reshape(-1, S)]
        values = np.concatenate([q for q, _ in pieces])
        scales = np.concatenate([s for _, s in pieces])
        with dist.transient(values), dist.transient(scales):
            with dist.transient(dist.all_to_all(values, group=group)) as got, \
                    dist.transient(dist.all_to_all(scales, group=group)) as got_scales:
                q_size, s_size = len(got) // (n * k), len(got_scales) // (n * k)
                total = np.zeros((k, S))
                for i in range(n):  # in group order: the same sum on every run
                    for j in range(k):
                        at = i * k + j
                        total[j] += dequantize(got[at * q_size:(at + 1) * q_size],
                                               got_scales[at * s_size:(at + 1) * s_size],
                                               self.bits, self.block, S, np.float64)
        return total
