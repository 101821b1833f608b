"""Mixture of experts and expert parallelism in the planner: capacity, expert bytes per
rank, the all-to-all traffic and its time. Tested against the emulator in
tests/plan/test_experts.py.

Per MoE layer and micro-batch of N tokens per rank (minipar/nn/moe.py,
minipar/parallel/expert.py):
    capacity       C = ceil(N k / E x c)
    buffer         E x C x d elements (padded to capacity: every slot moves, used or not)
    all-to-alls    4: dispatch and combine forward, and both again in backward
    sent per call  (ep-1)/ep x buffer bytes (one chunk to each peer)
    time per call  (ep-1) alpha + (ep-1)/ep buffer / B (the slowest link of the ep group)
Expert parameters per rank: E / ep experts of 2 d f + f + d elements (c_fc, c_proj with
biases; f = 4d in minipar's GELU expert, 3 d f without biases for a SwiGLU expert).

`MIXTRAL_8X7B`: Mixtral 8x7B's published MoE shape (Jiang et al. 2024, Table 1: 32
layers, d 4096, 8 experts, top-2, SwiGLU experts of hidden size 14336); the emulator's
expert is GELU with f = 4d, so the preset is for the planner's arithmetic only.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.distributed.clock import collective_time
from minipar.nn.moe import capacity


@dataclass(frozen=True)
class MoEShape:
    n_layer: int
    d_model: int
    num_experts: int
    top_k: int
    ffn_hidden: int | None = None   # None: 4 d (minipar's expert)
    swiglu: bool = False             # three bias-free matrices (Mixtral) instead of two
    moe_layer_freq: int = 1

    @property
    def moe_layers(self) -> int:
        return len(range(0, self.n_layer, self.moe_layer_freq))

    @property
    def expert_numel(self) -> int:
        d, f = self.d_model, self.ffn_hidden or 4 * self.d_model
        return 3 * d * f if self.swiglu else 2 * d * f + f + d


MIXTRAL_8X7B = MoEShape(n_layer=32, d_model=4096, num_experts=8, top_k=2,
                        ffn_hidden=14336, swiglu=True)


def expert_parameter_bytes(shape: MoEShape, ep: int, itemsize: int) -> int:
    """Bytes of expert parameters one rank holds: E / ep experts in every MoE layer."""
    return shape.moe_layers * (shape.num_experts // ep) * shape.expert_numel * itemsize


def all_to_all_sent_per_call(shape: MoEShape, tokens: int, capacity_factor: float,
                             ep: int, itemsize: int) -> int:
    """Bytes one rank sends in one all-to-all of an MoE layer (tokens: N per rank)."""
    cap = capacity(tokens, shape.num_experts, shape.top_k, capacity_factor)
    buffer = shape.num_experts * cap * shape.d_model * itemsize
    return (ep - 1) * buffer // ep


def all_to_all_per_step(shape: MoEShape, tokens: int, capacity_factor: float, ep: int,
                        micro_batches: int, itemsize: int) -> dict:
    """The all-to-alls of one optimizer step of one rank: calls and bytes sent."""
    calls = 4 * shape.moe_layers * micro_batches
    return {"calls": calls,
            "sent_bytes": calls * all_to_all_sent_per_call(shape, tokens, capacity_factor,
                                                           ep, itemsize)}


def all_to_all_seconds(shape: MoEShape, tokens: int, capacity_factor: float, ep: int,
                       micro_batches: int, itemsize: int, alpha: float,
                       bandwidth: float) -> float:
    """Simulated seconds of one step's all-to-alls on one rank (alpha-beta, blocking)."""
    cap = capacity(tokens, shape.num_experts, shape.top_k, capacity_factor)
    buffer = shape.num_experts * cap * shape.d_model * itemsize
    calls = 4 * shape.moe_layers * micro_batches
    return calls * collective_time("all_to_all", ep, buffer, alpha, bandwidth)

