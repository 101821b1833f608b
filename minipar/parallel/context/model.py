"""A GPT cut along the sequence over a CP group: `parallelize_context` converts a built
GPT (whole, a pipeline stage, tensor-parallel or not) in place.

Only attention mixes tokens, so only two places change: every block's attention becomes
ring attention over the CP group (ring_attention.py), and the embedding places my
tokens at their global positions (layout.py's cut). Everything else (LayerNorms, MLPs,
the loss) runs per token on my T/N tokens unchanged. Parameters are replicated over CP:
their gradients are averaged over DP x CP, Megatron's
`get_data_parallel_group(with_context_parallel=True)` (minipar's "dp-cp" group; its mesh
order "tp-cp-ep-dp-pp" keeps CP next to TP, `initialize_model_parallel` in
megatron/core/parallel_state.py).
"""

from __future__ import annotations

from minipar import distributed as dist
from minipar.nn import GPT, Module
from minipar.nn.gpt import CausalSelfAttention
from minipar.parallel.context.layout import positions
from minipar.parallel.context.ring_attention import ring_attention


class ContextParallelAttention(Module):
    """GPT-2's attention with ring attention over the CP group; the same c_attn, c_proj
    (so the same parameter names, and TP can still cut them by heads)."""

    def __init__(self, attention: CausalSelfAttention, cp_group, load_balance: bool):
        super().__init__()
        self.head_dim = attention.head_dim
        self.c_attn, self.c_proj = attention.c_attn, attention.c_proj
        self.resid_dropout = attention.resid_dropout
        self.cp_group, self.load_balance = cp_group, load_balance

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T/N, 3 * local_heads * head_dim)
        return self.resid_dropout(self.c_proj(
            ring_attention(qkv, self.head_dim, self.cp_group, self.load_balance)))


class ContextParallelPositionIds(Module):
    """The rows of wpe my tokens take: a sequence of T/N tokens (`sequence_shard` of the
    batch) sits at `positions` of the whole sequence of T, in my local order."""

    def __init__(self, seq_len: int, cp_group, load_balance: bool):
        super().__init__()
        self.size = cp_group.size
        self.seq_len = seq_len // self.size  # my tokens of the longest sequence
        self.rank = cp_group.ranks.index(dist.get_rank())
        self.load_balance = load_balance

    def forward(self, length: int):
        if length > self.seq_len:
            raise ValueError(f"context-parallel embedding: sequence length {length} "
                             f"exceeds seq_len / cp = {self.seq_len}: give each CP rank "
                             "its tokens (sequence_shard)")
        return positions(length * self.size, self.rank, self.size, self.load_balance)


def parallelize_context(model: GPT, cp_group, load_balance: bool = True) -> GPT:
    """Convert `model` in place to one CP rank's: every block's attention becomes
    `ContextParallelAttention`, the embedding's positions my tokens'. Returns it."""
    for block in model.h:
        block.attn = ContextParallelAttention(block.attn, cp_group, load_balance)
    if model.pre_process:
        model.position_ids = ContextParallelPositionIds(model.config.seq_len, cp_group,
                                                        load_balance)
    return model
