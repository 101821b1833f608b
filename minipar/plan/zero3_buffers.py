"""ZeRO-3's transient buffers while backward synchronises the gradients: the order of
minipar's `Zero3Optimizer` (minipar/parallel/zero/stage3.py and sharded.py), replayed on
element counts to find the rank's peak.

Backward visits the hooked calls ("sites": GPT.head, the blocks from the last, GPT.embed)
in reverse forward order. At each site:

    pre-backward     all-gather the site's units (or wait for a prefetched one), then
                     launch the all-gather of the previous site's units (prefetch: FSDP's
                     BACKWARD_PRE, DeepSpeed's stage3_prefetch_bucket_size)
    backward         the unit's full gradients are made, held until flattened
    reduce_bucket    with MAX_IN_FLIGHT reduce-scatters running, wait for the oldest
                     (under gradient accumulation its averaged piece is added into my
                     shard while its flat copy still lives), copy the unit's gradients
                     into one flat buffer, free them and the unit's gathered parameters,
                     launch the reduce-scatter (DeepSpeed's double-buffered reduction
                     with overlap_comm; without it, wait for it at once: no flat copy
                     stays in flight)

So the peak of a deep model, in the middle of its blocks, is one layer's gathered
parameters, the next one's being prefetched, the layer's gradients and two flat copies
(the layer's own and the one before it, or the two before it just before the oldest is
waited for): it does not grow with depth. FSDP2 bounds it alike: a unit's post-backward
reduce-scatters its gradients and keeps only the previous unit's reduce-scatter input
alive (`FSDPCommContext.reduce_scatter_state`,
torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).

A tied embedding is gathered by the head's call (the LM head is wte) and stays gathered to
the end of backward, when its gradient is complete. Where minipar differs: the head's
contribution to wte's gradient waits in the autograd engine, unbooked, until the embedding
lookup adds its own (a leaf's gradient is accumulated once complete, as PyTorch's
InputBuffer does; minipar/autograd/engine.py), so the planner does not count it either.
"""

from __future__ import annotations

from functools import lru_cache

from minipar.parallel.zero.sharded import MAX_IN_FLIGHT


def gpt_sites(n_units: int, embedding: bool, head: bool, tied: bool) -> tuple:
    """The units (indices into the forward-order units) each hooked call gathers, in
    forward order, as `gpt_units` registers them: GPT.embed the embedding, each block its
    own, GPT.head the head and, with tied embeddings, the embedding too."""
    first = 1 if embedding else 0
    last = n_units - 1 if head else n_units
    sites = [(0,)] if embedding else []
    sites += [(i,) for i in range(first, last)]
    if head:
        sites.append((last, 0) if tied and embedding else (last,))
    return tuple(sites)


@lru_cache(maxsize=256)  # a search asks again for every layout with these units
def backward_peak(units: tuple[int, ...], sites: tuple, n: int, param_bytes: int,
                  grad_bytes: int, *, prefetch: bool, overlap: bool, accumulate: bool,
                  kept: bool = False) -> int:
    """Peak bytes of ZeRO-3 buffers during one backward of one rank.

    units: elements of each gather unit in forward order (its flat buffers are padded to
    a multiple of n, the sharding group); sites: `gpt_sites`; prefetch: the previous
    site's all-gather launched at pre-backward; overlap: up to MAX_IN_FLIGHT
    reduce-scatters in flight (overlap_grad_reduce); accumulate: a micro-batch after the
    step's first, whose averaged pieces are added into the gradient shard; kept: every
    unit still gathered from its forward (FSDP2's reshard_after_forward=False).
    """
    padded = [-(-u // n) * n for u in units]
    piece = [p // n for p in padded]
    done_at = {}  # a unit's gradients are complete at the first site (in forward order) using it
    for k, site in enumerate(sites):
        for j in site:
            done_at.setdefault(j, k)
    gathered = set(range(len(units))) if kept else set()
    prefetched: set[int] = set()
    pending: list[int] = []
    # bytes held now: gathered (or being gathered) parameters and flat copies in flight
    params_held = param_bytes * sum(padded[j] for j in gathered)
    flats_held = 0
    peak = 0
    for k in reversed(range(len(sites))):
        for j in sites[k]:  # pre-backward: gather (a prefetched unit is already counted)
            if j not in gathered and j not in prefetched:
                params_held += param_bytes * padded[j]
            prefetched.discard(j)
            gathered.add(j)
        if prefetch and k > 0:
            for j in sites[k - 1]:
                if j not in gathered and j not in prefetched:
                    prefetched.add(j)
                    params_held += param_bytes * padded[j]
        for j in sites[k]:
            if done_at[j] != k:
                continue
            grads = grad_bytes * units[j]  # the unit's gradients, all made
            peak = max(peak, params_held + flats_held + grads)
            if overlap and len(pending) == MAX_IN_FLIGHT:  # wait for the oldest
                oldest = pending.pop(0)
                if accumulate:
                    peak = max(peak, params_held + flats_held + grads
                               + grad_bytes * piece[oldest])
                flats_held -= grad_bytes * padded[oldest]
            flat = grad_bytes * padded[j]
            peak = max(peak, params_held + flats_held + grads + flat)
            params_held -= param_bytes * padded[j]  # freed with the gradients
            gathered.discard(j)
            if overlap:
                pending.append(j)
                flats_held += flat
            elif accumulate:  # waited at once: its piece while the flat copy lives
                peak = max(peak, params_held + flat + grad_bytes * piece[j])
    for j in pending:  # the end of backward waits for the rest, oldest first
        if accumulate:
            peak = max(peak, params_held + flats_held + grad_bytes * piece[j])
        flats_held -= grad_bytes * padded[j]
    return peak
