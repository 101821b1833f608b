"""Expert parallelism: the E experts of every MoE layer split over the ep ranks of an
expert-parallel group, tokens moved to their expert and back by all-to-all.

One rank of an ep group (E_local = E / ep experts: ep_rank x E_local ...), per MoE layer
and micro-batch; the routing math is minipar/nn/moe.py's, unchanged:

    buffer (E, C, d)           my tokens' dispatch buffer, expert-major
    all_to_all (dispatch)      -> (ep, E_local, C, d): every rank's tokens for my experts
    my experts                 each on its ep x C rows
    all_to_all (combine)       -> (E, C, d): my tokens' expert outputs, back in place

and backward runs the two all-to-alls again, in reverse (the all-to-all is its own
transpose): four all-to-alls of E x C x d elements per MoE layer per micro-batch
(GShard, Lepikhin et al. 2021, section 3.2; Megatron-LM
megatron/core/transformer/moe/token_dispatcher.py `MoEAlltoAllTokenDispatcher`, which
permutes tokens, all-to-alls them and sorts them by local expert in `token_permutation`,
and undoes it in `token_unpermutation`). Megatron sends variable-sized chunks (no
capacity, `moe_expert_capacity_factor=None`, or dropless); minipar always pads to capacity,
so every chunk is E_local x C x d and the all-to-all has equal splits.

Gradients (Megatron-LM's expert-data-parallel layout, parallel_state.py and
distributed/distributed_data_parallel.py): non-expert parameters are replicas over the
whole DP group and averaged over it as before; an expert's gradient already sums the
tokens of the ep ranks that sent to it, so it is reduced over the expert-data-parallel
group only (dp / ep ranks) and scaled by edp / dp (Megatron's
`expert_gradient_scaling_factor`): the combine's backward scales the gradient entering my
experts by 1 / ep, the dispatch's backward undoes it for the tokens' gradient (exact for
a power of two), and the expert engine averages over edp: sum / dp, as a single device.

With the other strategies (docs/expert-parallel.md): under TP every rank of an ep group
has the same TP index and holds its TP slices of its experts (minipar/parallel/tensor/model.py,
`tensor_parallel_experts`), routing replicated tokens identically, so its all-to-all
moves the same E x C x d bytes as without TP; in a pipeline each stage keeps its own
layers' experts and trains their aux losses locally (minipar/nn/moe.py,
`MoEAuxLossAutoScaler`). `expert_layout_problem` is the rule for what is refused.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd.function import Function
from minipar.nn import GPT
from minipar.nn.moe import MoE, MoETokenDispatcher


class AllToAll(Function):
    """x -> all_to_all(x) over `group`; backward: the all-to-all of the gradient, times
    `grad_scale` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group, grad_scale):
        ctx.group, ctx.grad_scale = group, grad_scale
        return dist.all_to_all(x, group=group)

    @staticmethod
    def backward(ctx, grad):
        out = dist.all_to_all(np.ascontiguousarray(grad), group=ctx.group)
        if ctx.grad_scale != 1.0:
            out = out * np.asarray(ctx.grad_scale, dtype=out.dtype)
        return out, None, None


def local_expert_ids(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global ids of the experts ep rank `ep_rank` holds (a contiguous block)."""
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """The dispatcher of an expert-parallel rank (Megatron-LM's MoEAlltoAllTokenDispatcher):
    my tokens' buffer (E, C, d) -> all-to-all -> my E_local experts' ep x C rows each,
    and back. See the module docstring for the gradient scales."""

    def __init__(self, ep_group):
        super().__init__()
        self.ep_group = ep_group

    def dispatch(self, buffer):
        """(E, C, d) -> (E_local, ep x C, d): every rank's tokens for my experts."""
        e, cap, d = buffer.shape
        ep = self.ep_group.size
        received = AllToAll.apply(buffer, self.ep_group, float(ep))   # (ep * E_l, C, d)
        by_expert = received.reshape(ep, e // ep, cap, d).permute(1, 0, 2, 3)
        return by_expert.reshape(e // ep, ep * cap, d)

    def combine(self, out):
        """(E_local, ep x C, d) -> (E, C, d): my tokens' expert outputs, back in place."""
        local, rows, d = out.shape
        ep = self.ep_group.size
        back = out.reshape(local, ep, rows // ep, d).permute(1, 0, 2, 3)
        back = back.reshape(local * ep, rows // ep, d)
        return AllToAll.apply(back, self.ep_group, 1.0 / ep)            # (E, C, d)


def parallelize_experts(model: GPT, ep_group, ep_rank: int) -> GPT:
    """Convert `model` (a GPT, whole or a pipeline stage, tensor-parallel or not) in place
    to one expert-parallel rank's: every MoE layer keeps only my experts and dispatches
    through the ep group. Each rank builds the full initial weights first (their init is
    a function of the name), so the experts it keeps are the single device's (under TP,
    its slices of them). Returns it."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        keep = set(local_expert_ids(module.num_experts, ep_group.size, ep_rank))
        for e in module.experts.ids:
            if e not in keep:
                delattr(module.experts, str(e))
        module.experts.ids = tuple(sorted(keep))
        module.token_dispatcher = MoEAlltoAllTokenDispatcher(ep_group)
    return model


def expert_layout_problem(cp: int, zero: int, ep: int, offload_optimizer: str = "none",
                          offload_param: str = "none") -> tuple[str, str] | None:
    """(setting, reason) of a mix an MoE model cannot run yet, or None. It runs with
    --dp, --ep, --tp (with or without --sequence-parallel), --pp (every registered
    schedule) and --zero 0/1 (docs/expert-parallel.md); the training config and the
    planner raise what this returns, naming the flag."""
    if cp > 1:
        return "cp", (f"--cp {cp} with an MoE model is refused: each CP rank holds a piece "
                      "of every sequence, and routing (capacity, which tokens an expert "
                      "drops, the aux loss's token counts) would have to be decided over "
                      "the whole sequence, as Megatron's router does over its "
                      "sequence_partition_group; that is not built. Use --cp 1")
    if zero >= 2:
        what = "gradients and parameters" if zero == 3 else "gradients"
        return "zero", (f"--zero {zero} with an MoE model is refused: ZeRO-{zero} would "
                        f"partition the experts' {what} over the expert-data-parallel "
                        "group, and those buckets are not built; use --zero 1 (it shards "
                        "the optimizer states, the largest part) or --zero 0")
    for setting, device in (("offload_optimizer", offload_optimizer),
                            ("offload_param", offload_param)):
        if device != "none" and ep > 1:
            flag = "--" + setting.replace("_", "-")
            return setting, (f"{flag} with --ep {ep} is refused: expert parallelism runs "
                             "two engines (dense parameters over DP, experts over the "
                             "expert-data-parallel group), and offloading is built into "
                             f"one engine only; use --ep 1 with {flag}, or no offload")
    return None


def is_expert_parameter(name: str) -> bool:
    return ".mlp.experts." in name or name.startswith("mlp.experts.")
