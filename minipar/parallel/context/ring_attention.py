"""Context parallelism: every sequence cut across the ranks of a CP group, attention as
ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"), as Megatron-LM runs it through Transformer Engine's
`AttnFuncWithCPAndKVP2P` (transformer_engine/pytorch/attention.py) and picotron in
`picotron/context_parallel/context_parallel.py`.

A CP rank holds 1/N of every sequence's tokens through the whole model: embeddings,
LayerNorms, MLPs and the loss are per token and need nothing from the other ranks. Only
attention mixes tokens, and each query must see every earlier key. So the K/V blocks go
around the ring, N steps per layer, while each rank keeps its queries:

    step i: hold the K/V of rank (r - i) mod N; post isend(K/V -> r+1), irecv(<- r-1);
            attend my queries to the block held (the overlap: the transfer runs meanwhile);
            wait for the next block
    output = acc / l                                 (online softmax, below)

Each block's scores are folded into a running max m, sum l and output acc per query
(the online-softmax rescaling of FlashAttention, Dao et al. 2022, algorithm 1):

    m' = max(m, rowmax(s));  p = exp(s - m');  c = exp(m - m')
    l  = l c + rowsum(p);    acc = acc c + p v;  m = m'

so the (T, T) probabilities never exist; the backward recomputes each block's p from
the saved log-sum-exp lse = m + log l (FlashAttention's backward), and sends the K/V
again around the ring together with their gradients' running sums, which arrive at their
owners after N - 1 hops (TE's backward sends dK/dV the same way).

Which tokens a rank holds is layout.py's: N contiguous pieces, or by default Megatron's
load-balanced "zigzag" (rank r holds chunks r and 2N-1-r of 2N), so every rank attends
to the same number of chunk pairs under the causal mask. The model conversion (ring
attention in every block, my tokens' positions) is model.py's.

Per chunk pair (query chunk a, key chunk b): b < a attend fully, b == a causally,
b > a skip (all masked). Both layouts use this one rule; they differ in which chunks a
rank holds (`chunk_ids`).

Communication stays apart from the math: `RingExchange` is the only code here that
sends or receives, the block functions are pure NumPy, and `RingAttention` composes
them. Where minipar differs from TE: TE packs K and V (and in backward dK and dV) in one
buffer and runs flash-attention kernels per block; minipar keeps K/V in the
activations' dtype and the dK/dV partial sums in the compute dtype (fp32 under
bf16-mixed, so sums are not rounded at every hop), and its blocks are NumPy matmuls.
Attention dropout under CP is not implemented (refused in `validate_context_parallel`).

Shapes per rank (B batch, T sequence, N = cp, H local heads, hd head_dim):
    qkv (B, T/N, 3 H hd) -> out (B, T/N, H hd); K/V block sent (2, B, H, T/N, hd).
"""

from __future__ import annotations

import math

import numpy as np

from minipar import distributed as dist
from minipar.autograd.function import Function
from minipar.autograd.functional import causal_mask, row_dot, row_sum
from minipar.autograd.kernels import ring_attention_block_kernels
from minipar.autograd.placement import require_reduced
from minipar.autograd.precision import compute_dtype
from minipar.parallel.context.layout import chunk_ids

KV_TAG, DKV_TAG = 21, 22  # p2p tags of the K/V blocks and of their gradients' sums


# ---------------------------------------------------------------------------- the ring
class RingExchange:
    """The point-to-point traffic of one rank on the CP ring: send to the next rank,
    receive from the previous one (the only communication of ring attention).

    `rotate(array)` posts both and returns a `finish()` that waits; the caller computes
    in between, so the transfer overlaps the block (TE's double-buffered isend/irecv).
    """

    def __init__(self, group: dist.ProcessGroup):
        ranks = group.ranks
        me = ranks.index(dist.get_rank())
        self.group, self.size, self.index = group, len(ranks), me
        self.next, self.previous = ranks[(me + 1) % len(ranks)], ranks[me - 1]

    def send(self, array: np.ndarray, tag: int) -> dist.Work:
        return dist.isend(array, self.next, self.group, tag=tag)

    def receive(self, tag: int) -> dist.Work:
        """Post the receive from the previous rank; `wait()` returns the array, booked
        as a buffer in my ledger until `dist.release`."""
        return dist.irecv(self.previous, self.group, tag=tag, category="buffers")

    def rotate(self, array: np.ndarray, tag: int):
        """Pass `array` on and take the previous rank's; returns finish() -> received."""
        sent, received = self.send(array, tag), self.receive(tag)

        def finish() -> np.ndarray:
            out = received.wait()
            sent.wait()
            return out
        return finish


# ---------------------------------------------------------------------------- block math
def attending_pairs(my_chunks, their_chunks):
    """(i, j, causal) for each of my query chunks i and their key chunks j that attend:
    key chunk before query chunk fully, the same chunk causally, a later one not at all."""
    return [(i, j, kb == qa) for i, qa in enumerate(my_chunks)
            for j, kb in enumerate(their_chunks) if kb <= qa]


def block_scores(q, k, causal: bool, scale: float) -> np.ndarray:
    """scale q k^T of one chunk pair (..., c, c), causally masked on the diagonal."""
    s = (q * scale) @ k.swapaxes(-1, -2)
    if causal:
        s += causal_mask(s.shape[-1], s.dtype.name)
    return s


def online_softmax_update(s, v, m, l, acc) -> None:
    """Fold one block's scores s (..., c, c) and values v into the running max m, sum l
    (..., c, 1) and output acc (..., c, hd), in place (Dao et al. 2022, algorithm 1)."""
    m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
    p = np.exp(s - m_new)
    correction = np.exp(m - m_new)
    l *= correction
    l += row_sum(p)
    acc *= correction
    acc += p @ v
    m[...] = m_new


def block_backward(q, k, v, dout, lse, delta, causal: bool, scale: float):
    """Gradients of one chunk pair from the saved log-sum-exp (FlashAttention's
    backward): returns (dq, dk, dv) contributions. delta = rowsum(dout * out)."""
    p = np.exp(block_scores(q, k, causal, scale) - lse)
    dv = p.swapaxes(-1, -2) @ dout
    ds = dout @ v.swapaxes(-1, -2)
    ds -= delta
    ds *= p
    ds *= scale
    return ds @ k, ds.swapaxes(-1, -2) @ q, dv


# ---------------------------------------------------------------------------- the Function
def _split_heads(qkv: np.ndarray, head_dim: int):
    """qkv (B, T, 3 H hd) -> a view (3, B, H, T, hd) and H."""
    batch, length, width = qkv.shape
    n_heads = width // (3 * head_dim)
    heads = qkv.reshape(batch, length, 3, n_heads, head_dim)
    return heads.transpose(2, 0, 3, 1, 4), n_heads  # (3, B, H, T, hd), a view


class RingAttention(Function):
    """Causal self-attention over a sequence cut across the CP group, by ring attention.

    qkv: my tokens' (B, T/N, 3 H hd) in HF layout ([q heads | k heads | v heads]);
    returns (B, T/N, H hd). Equal to full causal attention on the whole sequence,
    restricted to my tokens. Saves qkv, the output and the log-sum-exp (B, H, T/N, 1).
    Charges each block's compute as it runs (dist.compute), so the simulated clock
    overlaps it with the transfer of the next block.
    """

    @staticmethod
    def forward(ctx, qkv, head_dim, group, load_balance):
        ring = RingExchange(group)
        n, r = ring.size, ring.index
        work = compute_dtype(qkv.dtype)
        heads, n_heads = _split_heads(qkv, head_dim)
        q = heads[0].astype(work)  # (B, H, T/N, hd)
        kv = np.ascontiguousarray(heads[1:])  # (2, B, H, T/N, hd), the activations' dtype
        mine = chunk_ids(r, n, load_balance)
        c = q.shape[2] // len(mine)  # tokens per chunk
        rows = [slice(i * c, (i + 1) * c) for i in range(len(mine))]
        scale = 1.0 / math.sqrt(head_dim)
        m = np.full(q.shape[:3] + (1,), -np.inf, dtype=work)
        l = np.zeros_like(m)
        acc = np.zeros_like(q)
        held = kv
        for step in range(n):
            owner = (r - step) % n
            finish = ring.rotate(held, KV_TAG) if step < n - 1 else None
            k, v = held[0].astype(work, copy=False), held[1].astype(work, copy=False)
            pairs = attending_pairs(mine, chunk_ids(owner, n, load_balance))
            for i, j, causal in pairs:
                s = block_scores(q[:, :, rows[i]], k[:, :, rows[j]], causal, scale)
                online_softmax_update(s, v[:, :, rows[j]], m[:, :, rows[i]],
                                      l[:, :, rows[i]], acc[:, :, rows[i]])
            _charge(pairs, q.shape, c, qkv.dtype.itemsize, "forward")
            if held is not kv:
                dist.release(held)
            if finish is not None:
                held = finish()
        acc /= l
        lse = m + np.log(l)
        batch, length = qkv.shape[:2]
        out = acc.transpose(0, 2, 1, 3).reshape(batch, length, n_heads * head_dim)
        out = out.astype(qkv.dtype, copy=False)
        ctx.save_for_backward(qkv, out, lse)
        ctx.head_dim, ctx.group, ctx.load_balance = head_dim, group, load_balance
        ctx.flops_forward = 0  # charged block by block above
        ctx.kernels_backward = ()  # likewise in backward
        return out

    @staticmethod
    def backward(ctx, grad):
        qkv, out, lse = ctx.saved_tensors
        head_dim, load_balance = ctx.head_dim, ctx.load_balance
        ring = RingExchange(ctx.group)
        n, r = ring.size, ring.index
        work = compute_dtype(qkv.dtype)
        heads, n_heads = _split_heads(qkv, head_dim)
        batch, length = qkv.shape[:2]
        q = heads[0].astype(work)
        kv = np.ascontiguousarray(heads[1:])
        dout = grad.astype(work, copy=False).reshape(batch, length, n_heads, head_dim)
        dout = dout.transpose(0, 2, 1, 3)
        o = out.astype(work, copy=False).reshape(batch, length, n_heads, head_dim)
        delta = row_dot(dout, o.transpose(0, 2, 1, 3))  # (B, H, T/N, 1)
        mine = chunk_ids(r, n, load_balance)
        c = q.shape[2] // len(mine)
        rows = [slice(i * c, (i + 1) * c) for i in range(len(mine))]
        scale = 1.0 / math.sqrt(head_dim)
        dq = np.zeros_like(q)
        own = None  # my contribution to my own K/V's gradient (kept home)
        sums = []  # Works of the dK/dV partial sums I passed on
        incoming = None  # the partial sum arriving for the block I hold next
        held = kv
        for step in range(n):
            owner = (r - step) % n
            finish = ring.rotate(held, KV_TAG) if step < n - 1 else None
            k, v = held[0].astype(work, copy=False), held[1].astype(work, copy=False)
            dkv = np.zeros((2,) + q.shape, dtype=work)
            pairs = attending_pairs(mine, chunk_ids(owner, n, load_balance))
            for i, j, causal in pairs:
                dqi, dkj, dvj = block_backward(
                    q[:, :, rows[i]], k[:, :, rows[j]], v[:, :, rows[j]],
                    dout[:, :, rows[i]], lse[:, :, rows[i]], delta[:, :, rows[i]],
                    causal, scale)
                dq[:, :, rows[i]] += dqi
                dkv[0][:, :, rows[j]] += dkj
                dkv[1][:, :, rows[j]] += dvj
            _charge(pairs, q.shape, c, qkv.dtype.itemsize, "backward")
            if step == 0:
                own = dkv
            else:
                # the partial sum of this block's owner's dK/dV goes on around the ring
                # (started by the rank after the owner at its step 1; after N - 1 hops
                # it is back home)
                if incoming is not None:
                    partial = incoming.wait()
                    dkv += partial
                    dist.release(partial)
                sums.append(ring.send(dkv, DKV_TAG))
            incoming = ring.receive(DKV_TAG) if step >= 1 else None
            if held is not kv:
                dist.release(held)
            if finish is not None:
                held = finish()
        if n > 1:
            partial = incoming.wait()  # my own K/V's gradient from everyone else
            own += partial
            dist.release(partial)
        for work_item in sums:
            work_item.wait()
        grad_qkv = np.empty((batch, length, 3, n_heads, head_dim), dtype=work)
        grad_qkv[:, :, 0] = dq.transpose(0, 2, 1, 3)
        grad_qkv[:, :, 1] = own[0].transpose(0, 2, 1, 3)
        grad_qkv[:, :, 2] = own[1].transpose(0, 2, 1, 3)
        return (grad_qkv.reshape(qkv.shape).astype(qkv.dtype, copy=False),
                None, None, None)


def _charge(pairs, q_shape, chunk: int, itemsize: int, kind: str) -> None:
    """Charge the compute of these chunk pairs to my clock now (both FLOP counts and
    kernels from minipar.autograd.kernels, the planner's source too)."""
    if not pairs:
        return
    batch, n_heads, _, head_dim = q_shape
    forward, backward = ring_attention_block_kernels(batch * n_heads, chunk, head_dim,
                                                     itemsize)
    kernels = (forward if kind == "forward" else backward) * len(pairs)
    dist.compute(sum(k.flops for k in kernels), kind, kernels)


def ring_attention(qkv, head_dim: int, group: dist.ProcessGroup, load_balance: bool = True):
    """Ring attention on my tokens' qkv over the CP `group`; see `RingAttention`."""
    require_reduced(qkv, "ring attention")
    return RingAttention.apply(qkv, head_dim, group, load_balance)
