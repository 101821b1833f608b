"""Mixture of experts: a block's MLP replaced by E expert MLPs behind a top-k router.

Per micro-batch of N = B x T tokens of width d (one device; expert parallelism moves the
buffer between ranks in minipar/parallel/expert/dispatch.py, the math here is unchanged):

    logits = x @ router.weight                 (N, E)   router.weight (d, E), no bias
    top_k  = argsort(-logits)[:, :k]           (N, k)   k distinct experts per token
    gates  = softmax(logits[top_k])            (N, k)   softmax over the chosen k
    capacity C = ceil(N k / E x c)                      c: the capacity factor
    slot of (token t, choice j) in expert e = how many tokens before t chose e;
        slot >= C: the assignment is dropped (its gate is 0; the residual carries t)
    buffer[e, s] = x[token in slot s of e]     (E, C, d) zeros where a slot is empty
    out[e]       = expert_e(buffer[e])         (E, C, d) an MLP d -> 4d -> d per expert
    y[t]         = sum_j gates[t, j] out[top_k[t, j], slot[t, j]]        (N, d)

Followed: Megatron-LM (commit d98e8a6) megatron/core/transformer/moe/ -- router.py (TopKRouter, a
bias-free (E, d) gate; minipar stores it (d, E) like its other Linear weights),
moe_utils.py `topk_softmax_with_capacity` (default `moe_router_pre_softmax=False`:
top-k of the logits, then a softmax over those k; `get_capacity` = ceil(N k / E x c);
its `drop_policy="position"`: an expert keeps the first C tokens in token order, GShard's
rule, Lepikhin et al. 2021, section 2.2; Megatron's default, "probs", keeps the C most
probable instead; `get_capacity` is called with N k tokens) and `switch_load_balancing_loss_func`:

    aux = coeff x E / (N^2 k) x sum_e (sum_t softmax(logits)[t, e]) x tokens_e

(Switch Transformer, Fedus et al. 2022, eq. 4: E sum_e f_e P_e), with tokens_e counted
before dropping, as Megatron counts them.

The aux loss reaches the gradients as in Megatron, by `MoEAuxLossAutoScaler`
(moe_utils.py; router.py applies it to the router's output): the block's output passes
through it unchanged, and its backward adds d(objective)/d(aux) = `aux_loss_scale` to the
aux loss's gradient. So the model's returned (and logged) loss is the LM loss, and a
pipeline stage's MoE layers get their aux-loss gradient locally, in the backward that
already runs there (the aux loss never travels down the pipeline). The scale is what the
backward seeds the LM loss with: 1 for `model(idx, targets).backward()`, 1/m with m
micro-batches per step (Megatron's schedules.py `forward_step` calls
`MoEAuxLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)`; here the scale is
an attribute of each layer, set by `set_aux_loss_scale`, not a class-wide global).

Each layer keeps what it routed in `last_routing` (tokens per expert before dropping,
dropped assignments, capacity) and sums it, and its aux loss, over the training forwards
in `routing_totals` (forwards with gradients on: an activation-checkpointed block counts
once, at its recomputation): the report's load-imbalance and aux-loss figures come from
there.
"""

from __future__ import annotations

import math

import numpy as np

from minipar.autograd import functional as F
from minipar.autograd.function import Function
from minipar.autograd.grad_mode import is_grad_enabled
from minipar.autograd.ops import concat
from minipar.autograd.tensor import Tensor
from minipar.nn.layers import Identity, Linear
from minipar.nn.module import Module, Parameter


class MoEAuxLossAutoScaler(Function):
    """Megatron's trick (moe_utils.py): forward returns `output` unchanged; backward passes
    the output's gradient through and gives `aux_loss` the gradient `scale` (the weight of
    the aux loss in the objective), so the aux loss is trained without being added to
    the returned loss."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.aux_dtype, ctx.scale = aux_loss.dtype, scale
        return output

    @staticmethod
    def backward(ctx, grad):
        return grad, np.asarray(ctx.scale, dtype=ctx.aux_dtype), None


def attach_aux_loss(output: Tensor, moe: MoE) -> Tensor:
    """`output` with `moe`'s aux loss of this forward hung on it (MoEAuxLossAutoScaler)."""
    if moe.aux_loss is None or not is_grad_enabled():
        return output
    return MoEAuxLossAutoScaler.apply(output, moe.aux_loss, moe.aux_loss_scale)


def set_aux_loss_scale(module: Module, scale: float) -> None:
    """Every MoE layer of `module` weighs its aux loss by `scale` in backward: the seed
    of the LM loss's backward (1 / micro-batches per step)."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = scale


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(N k / E x c) (Megatron moe_utils.get_capacity)."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def route(logits: np.ndarray, top_k: int, capacity_factor: float):
    """The routing decision (no gradient flows through it).

    logits (N, E) -> (top_k (N, k) expert ids, slot (N, k) slot in that expert or -1 if
    dropped, tokens_per_expert (E,) before dropping, C). Ties in the logits go to the lower
    expert id (a stable sort), so the decision is deterministic.
    """
    n, e = logits.shape
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    cap = capacity(n, e, top_k, capacity_factor)
    assigned = np.zeros((n, e), dtype=np.int64)
    assigned[np.arange(n)[:, None], chosen] = 1
    tokens_per_expert = assigned.sum(axis=0)
    # position of each token in each expert's queue, in token order (GShard's rule)
    position = np.cumsum(assigned, axis=0) - 1
    slot = position[np.arange(n)[:, None], chosen]
    slot = np.where(slot < cap, slot, -1)
    return chosen, slot, tokens_per_expert, cap


class Expert(Module):
    """One expert: c_fc (d, 4d) -> GELU (tanh) -> c_proj (4d, d), rows independent."""

    def __init__(self, d_model: int, *, dtype=np.float64):
        super().__init__()
        self.c_fc = Linear(d_model, 4 * d_model, dtype=dtype)
        self.c_proj = Linear(4 * d_model, d_model, dtype=dtype)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Experts(Module):
    """The experts this device holds, named by their global id (`experts.5.c_fc.weight`),
    so a rank holding experts 4..7 names its parameters as the full model does."""

    def __init__(self, expert_ids, d_model: int, *, dtype=np.float64):
        super().__init__()
        self.ids = tuple(expert_ids)
        for e in self.ids:
            setattr(self, str(e), Expert(d_model, dtype=dtype))

    def local(self, e: int) -> Expert:
        return getattr(self, str(e))


def run_local_experts(experts: Experts, buffer: Tensor) -> Tensor:
    """buffer (E_local, rows, d) -> each local expert on its rows -> (E_local, rows, d)."""
    outs = []
    for j, e in enumerate(experts.ids):
        rows = buffer[j]
        outs.append(experts.local(e)(rows).reshape(1, *rows.shape))
    return concat(outs, axis=0)


class MoETokenDispatcher(Module):
    """Moves the dispatch buffer to the experts that hold its rows and back (Megatron-LM's
    MoETokenDispatcher, megatron/core/transformer/moe/token_dispatcher.py). On one device
    every expert is here: dispatch and combine keep the buffer (E, C, d) as it is.
    Expert parallelism swaps in its all-to-all (minipar/parallel/expert/dispatch.py)."""

    def dispatch(self, buffer):
        """(E, C, d) my tokens by expert -> (E_local, rows, d) the rows of my experts."""
        return buffer

    def combine(self, out):
        """(E_local, rows, d) my experts' outputs -> (E, C, d) my tokens' by expert."""
        return out


class MoE(Module):
    """Drop-in for a block's MLP: x (B, T, d) -> (B, T, d), plus `self.aux_loss`.

    `token_dispatcher` moves the dispatch buffer (E, C, d) to the experts and back;
    expert parallelism swaps it and keeps only its experts (`expert_ids`). With sequence
    parallelism, tensor parallelism swaps the two Identity places around the routing:
    my tokens' pieces all-gathered before it, my piece of the output kept after.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, capacity_factor: float,
                 aux_loss_coeff: float, *, dtype=np.float64, expert_ids=None):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.aux_loss_coeff = capacity_factor, aux_loss_coeff
        self.router = Module()
        self.router.weight = Parameter(np.zeros((d_model, num_experts), dtype=dtype))
        ids = range(num_experts) if expert_ids is None else expert_ids
        self.experts = Experts(ids, d_model, dtype=dtype)
        self.token_dispatcher = MoETokenDispatcher()
        self.gather_from_sequence_parallel = Identity()
        self.scatter_to_sequence_parallel = Identity()
        self.aux_loss: Tensor | None = None
        self.aux_loss_scale = 1.0  # d(objective)/d(aux_loss): set_aux_loss_scale
        self.last_routing: dict | None = None
        self.routing_totals = {"tokens_per_expert": [0] * num_experts, "dropped": 0,
                               "assigned": 0, "forwards": 0, "aux_loss": 0.0}

    def forward(self, x):
        x = self.gather_from_sequence_parallel(x)
        b, t, d = x.shape
        n, e, k = b * t, self.num_experts, self.top_k
        tokens = x.reshape(n, d)
        logits = tokens @ self.router.weight                                  # (N, E)
        chosen, slot, tokens_per_expert, cap = route(logits.data, k, self.capacity_factor)
        rows = np.arange(n)[:, None]
        gates = F.softmax(logits[rows, chosen])                               # (N, k)
        kept = slot >= 0
        gates = gates * kept.astype(gates.dtype)  # a dropped assignment contributes 0

        # dispatch: buffer[e, s] = tokens[token in slot s of e]; row n is a zero row
        source = np.full((e, cap), n, dtype=np.int64)
        source[chosen[kept], slot[kept]] = np.broadcast_to(rows, chosen.shape)[kept]
        padded = concat([tokens, Tensor(np.zeros((1, d), dtype=tokens.dtype))], axis=0)
        buffer = padded[source]                                               # (E, C, d)
        local = run_local_experts(self.experts, self.token_dispatcher.dispatch(buffer))
        out = self.token_dispatcher.combine(local)                            # (E, C, d)

        # combine: y[t] = sum_j gates[t, j] out[chosen[t, j], slot[t, j]]
        flat = concat([out.reshape(e * cap, d),
                       Tensor(np.zeros((1, d), dtype=out.dtype))], axis=0)
        where = np.where(kept, chosen * cap + slot, e * cap)                  # (N, k)
        y = (flat[where] * gates.reshape(n, k, 1)).sum(axis=1)                # (N, d)

        probs = F.softmax(logits)                                             # (N, E)
        scale = self.aux_loss_coeff * e / (n * n * k)
        self.aux_loss = (probs.sum(axis=0) * tokens_per_expert.astype(probs.dtype)
                         ).sum() * scale
        self.last_routing = {"tokens_per_expert": tokens_per_expert.tolist(),
                             "dropped": int((~kept).sum()), "assigned": n * k,
                             "capacity": cap}
        if is_grad_enabled():
            totals = self.routing_totals
            totals["tokens_per_expert"] = [a + b for a, b in zip(
                totals["tokens_per_expert"], tokens_per_expert.tolist(), strict=True)]
            totals["dropped"] += int((~kept).sum())
            totals["assigned"] += n * k
            totals["forwards"] += 1
            totals["aux_loss"] += float(self.aux_loss.data)
        return self.scatter_to_sequence_parallel(y.reshape(b, t, d))
