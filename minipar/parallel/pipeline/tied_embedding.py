"""A tied embedding across pipeline stages: Megatron-LM's embedding group.

GPT-2 ties its LM head to the token embedding wte. Cut into stages, wte is used by the
first virtual stage (embedding) and the last (head), usually on different ranks. Each of
those ranks keeps its own copy; after every step's backward they all-reduce the two
copies' gradients (`all_reduce_grads`, Megatron-LM's `_allreduce_embedding_grads` in
megatron/core/distributed/finalize_model_grads.py), so both hold embedding + head
gradient, take the same update and stay equal. In a V placement (ZB-V, DualPipe-V) the
first and last stage are both on rank 0: its two chunks share one wte and nothing is
sent.

Either way the tied gradient is final only after the whole schedule (both uses have
added into it), so the data-parallel engine reduces it last (`late_reduced`).
"""

from __future__ import annotations

from minipar import distributed as dist
from minipar.errors import PipelineError


class TiedEmbedding:
    """Which of my chunks hold a copy of a tied wte, and the group that sums them.

    config: the GPT shape; pp_group, pp_rank: my pipeline group and my rank in it;
    schedule: its placement says which ranks hold the first and last virtual stage;
    chunks: my model chunks (GPTs over their layers), in chunk order."""

    def __init__(self, config, pp_group, schedule, pp_rank: int, chunks: list) -> None:
        num_stages = schedule.pp * schedule.virtual_stages
        first, last = schedule.rank_of(0), schedule.rank_of(num_stages - 1)
        tied = config.tie_embeddings and num_stages > 1
        if tied and schedule.pp == 1:
            raise PipelineError("a tied embedding needs the first and last virtual stage on "
                                "different ranks: use pp >= 2 or one virtual stage")
        self.embedding, self.head = (next((c for c in chunks if getattr(c, flag)), None)
                                     for flag in ("pre_process", "post_process"))
        # A V holds embedding and head on one rank: its two chunks share one wte.
        self.shared = tied and first == last == pp_rank
        if self.shared:
            self.head.wte = self.embedding.wte
        self.group = None  # Megatron's embedding group: the ranks of the two copies
        if tied and first != last:
            self.group = dist.new_group(sorted([pp_group.ranks[first],
                                                pp_group.ranks[last]]), kind="pp")
        self.mine = [c.wte.weight for c in (self.embedding, self.head)
                     if self.group is not None and c is not None]

    def copies(self) -> list:
        """The last stage's own copy of wte, if this rank holds it: it is not counted
        twice (norm, state dict), being equal to the first stage's after every step."""
        if self.group is None or self.head is None or self.embedding is not None:
            return []
        return [self.head.wte.weight]

    def late_reduced(self) -> list:
        """My wte parameters whose gradient is final only after the schedule."""
        return self.mine + ([self.embedding.wte.weight] if self.shared else [])

    def all_reduce_grads(self) -> None:
        """Sum the gradients of the first and last stage's copies of wte."""
        for weight in self.mine:
            with dist.phase("backward"):
                weight.grad[...] = dist.all_reduce(weight.grad, "sum", group=self.group)
