"""Context parallelism's formulas: what ring attention sends, how its work is spread
over the ranks, and how long a layer's attention takes with the K/V exchange overlapped
(minipar/parallel/context/ring_attention.py runs it; tests/plan/test_context.py holds these against
the emulator's byte ledger and simulated clock).

Bytes one CP rank sends per layer and micro-batch (b sequences of s tokens, N = cp,
h/t the rank's share of K's width h = n_kv_head x head_dim (d_model without grouped-query
attention, whose K/V are n_head/n_kv_head times narrower: TE's `AttnFuncWithCPAndKVP2P`
sends the kv groups only; the Llama 3 paper, section 3.3.2, all-gathers them for that
reason), e the activations' bytes, e_g the gradients'
running sums' (fp32 under bf16-mixed, else e)):

    forward   (N-1) x 2 b (s/N) (h/t) e            K and V, N-1 hops (Liu et al. 2023)
    backward  (N-1) x 2 b (s/N) (h/t) (e + e_g)    K and V again, and dK, dV home

Work. The sequence is cut into N chunks (or 2N with load balancing) and a query chunk
attends to the key chunks at or before it; every chunk pair costs the same. Without load
balancing rank r computes r + 1 pairs of (s/N)^2 (steps 0..r of the ring), so the
slowest rank does 2N/(N+1) times the mean; with it every rank computes 2N+1 pairs of
(s/2N)^2, 3 at step 0 (its own chunks) and 2 at every later step (Megatron-LM's zigzag
chunks, megatron/core/utils.py; TE's `AttnFuncWithCPAndKVP2P` splits steps the same way).
A causal FlashAttention kernel skips the upper half of each diagonal pair, so on the
clusters priced with FlashAttention a rank's step 0 costs about 2 pairs, not 3: CP then
splits the half of the scores that attention without CP computes too.

Time: `ring_times` walks the ring as the emulator does: at each step a rank posts the
next block's send and receive, computes its pairs, then waits for the block (so a
transfer hides behind compute when the compute is longer); in backward the dK/dV sums
go one hop per step behind the K/V. Link contention is not modelled (as in the
emulator).
"""

from __future__ import annotations

from minipar.autograd.kernels import flash_causal_share, ring_attention_block_kernels
from minipar.plan.shapes import SOFTMAX_FLOPS, ModelShape


def ring_attention_bytes(b: int, s: int, h: int, cp: int, itemsize: int, tp: int = 1,
                         gradient_itemsize: int | None = None) -> tuple[int, int]:
    """(forward, backward) bytes one CP rank sends per layer and micro-batch."""
    gradient_itemsize = itemsize if gradient_itemsize is None else gradient_itemsize
    elements = 2 * b * (s // cp) * (h // tp)  # K and V of my tokens, my heads
    return (cp - 1) * elements * itemsize, (cp - 1) * elements * (itemsize
                                                                   + gradient_itemsize)


def chunk_tokens(s: int, cp: int, load_balance: bool) -> int:
    return s // (2 * cp if load_balance else cp)


def pairs_per_step(cp: int, load_balance: bool, count_masked: bool = False,
                   diagonal: float = 1) -> list[list[float]]:
    """[rank][step]: chunk pairs rank r computes at ring step i (it holds the K/V of
    rank (r - i) mod N). count_masked: count every pair, masked or not (the FLOP count's
    convention with FlashAttention, which counts all s^2 scores of causal attention, as
    the model's count without CP does). diagonal: the share of a pair on the diagonal (a
    chunk against its own keys, at step 0) computed: 1 in minipar's ring, which masks
    it; `diagonal_share` for a causal FlashAttention kernel, which skips its upper half."""
    if count_masked:
        return [[4 if load_balance else 1] * cp for _ in range(cp)]
    if load_balance:  # step 0: two diagonal pairs and one whole; later steps: two whole
        return [[1 + 2 * diagonal if i == 0 else 2 for i in range(cp)] for _ in range(cp)]
    return [[diagonal if i == 0 else 1 if i <= r else 0 for i in range(cp)]
            for r in range(cp)]


def diagonal_share(chunk: int, flash_attention: bool) -> float:
    """The share of a diagonal chunk pair the kernel computes: FlashAttention's causal
    kernel skips the key blocks above the diagonal (TE's `AttnFuncWithCPAndKVP2P` runs
    the step-0 blocks causal); minipar's blocks compute it whole and mask it."""
    return flash_causal_share(chunk) if flash_attention else 1


def attention_imbalance(cp: int, load_balance: bool) -> float:
    """The busiest rank's attention work over the mean: 2N/(N+1) without load
    balancing, 1 with it."""
    work = [sum(steps) for steps in pairs_per_step(cp, load_balance)]
    return max(work) / (sum(work) / len(work))


def pair_flops(heads: int, c: int, d: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one chunk pair (c tokens each, `heads` (sequence,
    head) pairs of head_dim d): minipar's kernel list (autograd.kernels)."""
    forward, backward = ring_attention_block_kernels(heads, c, d, 1)
    return sum(k.flops for k in forward), sum(k.flops for k in backward)


def ring_times(step_compute: list[list[float]], kv_transfer: float,
               dkv_transfer: float | None = None, start: list[float] | None = None
               ) -> list[float]:
    """When each rank finishes one ring attention (forward; backward if dkv_transfer is
    given), from each rank's compute per step, the time of one hop (alpha + S/B) and
    when each rank starts (default: all at 0; the backward starts where each rank's
    forward ended, which differs between ranks without load balancing).

    Forward, per step i < N-1: post send and receive at t, compute, then wait for the
    block: t' = max(t + c, transfer end). A transfer starts when both ends have posted.
    Backward adds the dK/dV sums: sent after step i's compute (i >= 1, added to the sum
    that arrived for that block), received (posted after the send) before the next
    send, and the last one, my own K/V's gradient, after the loop.
    """
    n = len(step_compute)
    t = [0.0] * n if start is None else list(start)
    if n == 1:
        return [t[0] + step_compute[0][0]]
    previous_sum_end = [None] * n  # when the dK/dV sum sent to me last step arrives
    for i in range(n):
        post = list(t)
        done = [t[r] + step_compute[r][i] for r in range(n)]
        if dkv_transfer is not None and i >= 1:
            # wait for the incoming sum (sent at the previous rank's step i-1), then send
            sent_at = [max(done[r], previous_sum_end[r]) if i >= 2 else done[r]
                       for r in range(n)]
            # my sum travels to r+1, whose receive is posted right after its own send
            previous_sum_end = [max(sent_at[r - 1], sent_at[r]) + dkv_transfer
                                for r in range(n)]
            done = sent_at
        if i < n - 1:
            # block r-1 -> r: both ends posted at step start; my send to r+1 likewise
            arrive = [max(post[r - 1], post[r]) + kv_transfer for r in range(n)]
            sent = [max(post[r], post[(r + 1) % n]) + kv_transfer for r in range(n)]
            t = [max(done[r], arrive[r], sent[r]) for r in range(n)]
        else:
            t = done
    if dkv_transfer is not None:
        # my own K/V's gradient arrives; my last sum reaches the next rank
        t = [max(t[r], previous_sum_end[r], previous_sum_end[(r + 1) % n])
             for r in range(n)]
    return t


def serial_ring_time(step_compute: list[float], kv_transfer: float,
                     dkv_transfer: float | None = None) -> float:
    """The same work with no overlap: every hop after its block (the upper bound)."""
    hops = len(step_compute) - 1
    extra = 0.0 if dkv_transfer is None else hops * dkv_transfer
    return sum(step_compute) + hops * kv_transfer + extra


# ---------------------------------------------------------------------------- the planner's use
def local_shape(shape: ModelShape, cp: int) -> ModelShape:
    """The model as one CP rank runs it: s/cp tokens per sequence through every layer
    (the parameters are the full model's: use `shape` for those)."""
    return shape if cp == 1 else shape.with_seq_len(shape.seq_len // cp)


def busiest_pairs(cp: int, load_balance: bool, count_masked: bool = False,
                  diagonal: float = 1) -> float:
    """Chunk pairs the busiest rank computes per layer (the one everyone waits for)."""
    return max(sum(steps) for steps in pairs_per_step(cp, load_balance, count_masked,
                                                       diagonal))


def attention_flops_correction(shape: ModelShape, b: int, tp: int, cp: int,
                               load_balance: bool, count_masked: bool = False
                               ) -> tuple[float, float]:
    """(forward, backward) FLOPs to add to `local_shape(shape, cp).layer_flops(b, tp)`
    per layer on the busiest CP rank: that counts one (s/cp)^2 block of full attention,
    ring attention computes `busiest_pairs` chunk pairs and recomputes p in backward."""
    if cp == 1:
        return 0.0, 0.0
    s, d = shape.seq_len // cp, shape.head_dim
    heads = b * shape.n_head // tp
    counted_f = 4 * heads * s * s * d + SOFTMAX_FLOPS[0] * heads * s * s
    counted_b = 8 * heads * s * s * d + SOFTMAX_FLOPS[1] * heads * s * s
    pair_f, pair_b = pair_flops(heads, chunk_tokens(shape.seq_len, cp, load_balance), d)
    pairs = busiest_pairs(cp, load_balance, count_masked)
    return pairs * pair_f - counted_f, pairs * pair_b - counted_b


def exposed_ring_seconds(pair_seconds: tuple[float, float], cp: int, load_balance: bool,
                         kv_hop: float, dkv_hop: float, diagonal: float = 1
                         ) -> tuple[float, float]:
    """(forward, backward) seconds per layer that the ring's transfers add to the busiest
    rank's attention compute (`ring_times` minus the compute it overlaps). Exact with
    load balancing (every rank alike); without it, the last rank's path."""
    if cp == 1:
        return 0.0, 0.0
    pairs = pairs_per_step(cp, load_balance, diagonal=diagonal)
    forward = [[p * pair_seconds[0] for p in steps] for steps in pairs]
    backward = [[p * pair_seconds[1] for p in steps] for steps in pairs]
    forward_end = ring_times(forward, kv_hop)
    backward_end = ring_times(backward, kv_hop, dkv_hop, start=forward_end)
    busiest_f = max(sum(steps) for steps in forward)
    busiest_b = max(sum(steps) for steps in backward)
    return (max(forward_end) - busiest_f,
            max(backward_end) - max(forward_end) - busiest_b)


__all__ = [
    "attention_flops_correction",
    "busiest_pairs",
    "exposed_ring_seconds",
    "local_shape",
    "attention_imbalance",
    "chunk_tokens",
    "diagonal_share",
    "pair_flops",
    "pairs_per_step",
    "ring_attention_bytes",
    "ring_times",
    "serial_ring_time",
]
