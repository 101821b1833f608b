"""How context parallelism cuts every sequence over the ranks of a CP group, and which
layouts it refuses (ring_attention.py is the attention that runs on the pieces).

Causality and load balancing. With the sequence cut into N contiguous pieces, rank 0's
queries see one block and rank N-1's see N: rank N-1 does 2N/(N+1) times the average
work and everyone waits for it. Megatron-LM cuts the sequence into 2N chunks instead and
gives rank r chunks r and 2N-1-r, one early and one late ("zigzag":
`get_batch_on_this_cp_rank` -> `_get_batch_on_this_cp_rank_per_sequence_balancing` in
megatron/core/utils.py), so every rank computes the same number of chunk pairs: 2N-1 full
ones and 2 diagonal (causally masked) ones. Token ids, position embeddings and targets
follow the same permutation (`sequence_shard`, `positions`).
"""

from __future__ import annotations

import numpy as np

from minipar.nn import GPTConfig

SELECTIVE_WITH_CP = ("selective recomputation (the attention core) with --cp: ring "
                     "attention already keeps no (s, s) scores for backward, only q, k, v, "
                     "its output and the log-sum-exp, so there is nothing to recompute; "
                     "drop --recompute-granularity selective, or use full")
SEQUENCE_DIM = 1  # activations and token ids are (B, T, ...)

def chunk_ids(cp_rank: int, cp_size: int, load_balance: bool) -> tuple[int, ...]:
    """The chunks of the sequence rank `cp_rank` holds, in its local order: (r,) of N
    equal chunks, or (r, 2N-1-r) of 2N with load balancing (Megatron-LM's zigzag
    `_get_batch_on_this_cp_rank_per_sequence_balancing`)."""
    if not load_balance:
        return (cp_rank,)
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def chunks_per_sequence(cp_size: int, load_balance: bool) -> int:
    return 2 * cp_size if load_balance else cp_size


def positions(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool) -> np.ndarray:
    """Global positions (T/N,) of my tokens, in my local order."""
    size = seq_len // chunks_per_sequence(cp_size, load_balance)
    return np.concatenate([np.arange(c * size, (c + 1) * size)
                           for c in chunk_ids(cp_rank, cp_size, load_balance)])


def sequence_shard(x: np.ndarray, cp_rank: int, cp_size: int, load_balance: bool):
    """My tokens of x (B, T, ...) along the sequence: (B, T/N, ...), a copy (as if this
    rank had loaded only its share). Token ids and targets go through this same cut."""
    return np.ascontiguousarray(x[:, positions(x.shape[SEQUENCE_DIM], cp_rank, cp_size,
                                               load_balance)])


def validate_context_parallel(config: GPTConfig, cp: int, load_balance: bool,
                              tp: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse a model whose sequence cannot be cut over `cp` ranks, naming the fix."""
    pieces = chunks_per_sequence(cp, load_balance)
    if config.seq_len % pieces:
        how = (f"2 x cp = {pieces} chunks (load balancing: rank r keeps chunks r and "
               f"2cp-1-r)" if load_balance else f"cp = {cp} pieces")
        raise ValueError(f"--cp {cp}: seq_len={config.seq_len} does not split into {how}; "
                         f"choose --seq-len a multiple of {pieces}")
    if sequence_parallel and (config.seq_len // cp) % tp:
        raise ValueError(f"--sequence-parallel with --cp {cp}: each CP rank's "
                         f"{config.seq_len // cp} tokens do not split over --tp {tp}; "
                         f"choose --seq-len a multiple of {cp * tp}")
    if config.grouped_query:
        raise ValueError(f"--n-kv-head {config.kv_heads} with --cp {cp}: ring attention "
                         "over shared key/value heads is not implemented; drop --n-kv-head "
                         "or --cp")
    if config.dropout > 0:
        raise ValueError(f"--dropout {config.dropout} with --cp {cp}: attention dropout "
                         "inside ring attention (and masks that follow the sequence "
                         "permutation) is not implemented; use --dropout 0")
