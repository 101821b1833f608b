"""Which activations to recompute in backward: Megatron-LM's three knobs.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 5) split a layer's saved activations, 34sbh + 5as^2b bytes in 16-bit,
into the part that grows with s^2 (the attention core softmax(QK^T)V: its scores,
probabilities and dropout mask) and the rest. Recomputing only the core ("selective")
removes the 5as^2b term for a few percent more FLOPs; recomputing whole layers ("full")
keeps only each layer's 2sbh input for a whole extra forward. Megatron-LM exposes this as
(megatron/core/transformer/transformer_config.py, megatron/core/recompute.py, commit
d98e8a64):

    --recompute-granularity selective   checkpoint the core attention of every layer
                                        (Megatron's recompute_modules default "core_attn")
    --recompute-granularity full        checkpoint whole layers, chosen by the method:
      --recompute-method uniform          groups of --recompute-num-layers consecutive
        --recompute-num-layers k          layers, each group one checkpoint (its input
                                          kept, the whole group recomputed at once)
      --recompute-method block            only the first k layers of each pipeline chunk,
        --recompute-num-layers k          one checkpoint each; the others keep everything

`num_layers` counts layers of one model chunk (Megatron's `num_layers_per_pipeline_rank`
is `len(self.layers)` of one TransformerBlock, a virtual stage under interleaving).
`--recompute-granularity full` without a method recomputes every layer, i.e. full /
uniform / 1 (Megatron's docstring: "if None, and recompute is enabled, all layers will
do recomputation"; its validation instead insists on a method and a count).

The rules (validation) live here once (`recompute_problem`); TrainConfig, the planner's
ParallelConfig and a hand-built `Recompute` raise them as ConfigError naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.autograd.checkpoint import checkpoint
from minipar.autograd.grad_mode import is_grad_enabled
from minipar.errors import ConfigError

GRANULARITIES = ("selective", "full")
METHODS = ("uniform", "block")


@dataclass(frozen=True)
class Recompute:
    """A recomputation policy: granularity None (keep everything), "selective" or
    "full"; for full, method "uniform" or "block" and num_layers k >= 1."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.granularity == "full" and self.method is None and self.num_layers is None:
            raise ConfigError("recompute_method", "Recompute('full') needs a method and a "
                              "count, e.g. Recompute('full', 'uniform', 1) (every layer)")
        # (the count against a chunk's layers is the config's check: it knows the model)
        problem = recompute_problem(False, self.granularity, self.method, self.num_layers,
                                    layers_per_chunk=self.num_layers or 1)
        if problem is not None:
            raise ConfigError(*problem)

    @classmethod
    def from_settings(cls, activation_checkpointing: bool = False,
                      granularity: str | None = None, method: str | None = None,
                      num_layers: int | None = None) -> Recompute:
        """The policy of a config's flags (assumed valid: see `recompute_problem`)."""
        if activation_checkpointing or (granularity == "full" and method is None):
            return cls("full", "uniform", 1)  # every layer its own checkpoint
        if granularity == "full":
            return cls("full", method, num_layers)
        return cls(granularity)

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def segments(self, n_layers: int) -> list[tuple[int, int, bool]]:
        """(start, end, checkpointed) runs of a chunk's n_layers layers, in order.

            Recompute("full", "uniform", 2).segments(5)
                -> [(0, 2, True), (2, 4, True), (4, 5, True)]
            Recompute("full", "block", 2).segments(4)
                -> [(0, 1, True), (1, 2, True), (2, 3, False), (3, 4, False)]
        """
        if not self.full:
            return [(i, i + 1, False) for i in range(n_layers)]
        k = self.num_layers
        if self.method == "uniform":
            return [(i, min(i + k, n_layers), True) for i in range(0, n_layers, k)]
        return [(i, i + 1, i < k) for i in range(n_layers)]

    def recomputed_layers(self, n_layers: int) -> int:
        """Layers of a chunk of n_layers whose whole forward runs again in backward
        (segments' checkpointed layers: every one under uniform, the first k under block)."""
        if not self.full:
            return 0
        return n_layers if self.method == "uniform" else min(self.num_layers, n_layers)

    def to_flags(self) -> dict:
        """The config settings of this policy (activation_checkpointing off: the
        recompute_* flags say everything)."""
        return {"activation_checkpointing": False, "recompute_granularity": self.granularity,
                "recompute_method": self.method, "recompute_num_layers": self.num_layers}

    @property
    def label(self) -> str:
        """Short text for tables: none, selective, full, block 2, uniform 3."""
        if self.granularity is None:
            return "none"
        if self.selective:
            return "selective"
        if (self.method, self.num_layers) == ("uniform", 1):
            return "full"
        return f"{self.method} {self.num_layers}"


def recompute_problem(activation_checkpointing: bool, granularity, method, num_layers,
                      layers_per_chunk: int) -> tuple[str, str] | None:
    """(setting, message) of the first inconsistent recomputation flag, or None.

    layers_per_chunk: the most layers one model chunk holds (n_layer over pp x
    virtual_stages, rounded up), the largest useful --recompute-num-layers.
    """
    if granularity is not None and granularity not in GRANULARITIES:
        return "recompute_granularity", (f"must be one of {', '.join(GRANULARITIES)}; got "
                                         f"{granularity!r}")
    if method is not None and method not in METHODS:
        return "recompute_method", f"must be one of {', '.join(METHODS)}; got {method!r}"
    if activation_checkpointing and granularity is not None:
        return "recompute_granularity", (
            "--activation-checkpointing already means full recomputation of every layer "
            "(--recompute-granularity full); give one of the two")
    if granularity != "full" and (method is not None or num_layers is not None):
        which = "recompute_method" if method is not None else "recompute_num_layers"
        return which, ("only applies to --recompute-granularity full (selective always "
                       "recomputes the attention core of every layer, as in Megatron-LM)")
    if granularity == "full" and (method is None) != (num_layers is None):
        return ("recompute_num_layers" if num_layers is None else "recompute_method",
                "--recompute-method and --recompute-num-layers go together (or give "
                "neither: every layer is recomputed)")
    if num_layers is not None:
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            return "recompute_num_layers", (f"must be a positive integer, got {num_layers!r} "
                                            "(no recomputation: leave out "
                                            "--recompute-granularity)")
        if num_layers > layers_per_chunk:
            return "recompute_num_layers", (
                f"{num_layers} layers but a pipeline chunk holds at most {layers_per_chunk} "
                f"(n_layer / (pp x virtual_stages)); use 1 to {layers_per_chunk}")
    return None


def run_blocks(blocks, x, recompute: Recompute, generator=None):
    """x through `blocks` in order, checkpointing the segments `recompute` chooses.

    With full uniform k = 1 this is `checkpoint(block, x)` per block. `generator`: the
    dropout masks' generator, so a recomputed segment draws the same masks.
    """
    if not recompute.full or not is_grad_enabled():
        for block in blocks:
            x = block(x)
        return x
    blocks = list(blocks)
    for start, end, checkpointed in recompute.segments(len(blocks)):
        segment = blocks[start] if end - start == 1 else _Segment(blocks[start:end])
        x = checkpoint(segment, x, generator=generator) if checkpointed else segment(x)
    return x


class _Segment:
    """Consecutive blocks run as one function (a uniform group: one checkpoint)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x
