"""What one pipeline stage holds: the model cut into pp x v pieces of consecutive layers.

What a stage holds (Huang et al. 2019, GPipe; Megatron-LM's `get_model` with
pre_process / post_process). The layers are cut into pp * v contiguous pieces, v the
virtual stages per rank (1 unless the schedule is interleaved); chunk c of pipeline rank r
is the virtual stage its schedule's placement says (c * pp + r for interleaving):
    first virtual stage   wte, wpe (+ dropout)   then its blocks
    every virtual stage   blocks h.{i}, registered under their *global* index i
    last virtual stage    its blocks, then ln_f and the LM head and the loss
So `named_parameters()` of a stage yields the single-device (Hugging Face) names, and
consolidation is a union of dictionaries. With a tied LM head (GPT-2's default) the last
stage keeps its own copy of wte; after every step's backward the first and last stage
all-reduce the gradient of their copies (Megatron's "embedding group"), so both copies
receive the same update and stay equal.

`split_layers` cuts the layers; `PipelineStage` is one virtual stage (a model chunk).
The executor that runs a schedule over these chunks is minipar/parallel/pipeline/executor.py;
`minipar.train.checkpoint.assemble` joins the stages' pieces back into one state dict.
"""


from __future__ import annotations

import zlib

import numpy as np

from minipar.autograd import Tensor
from minipar.autograd import functional as F
from minipar.autograd.precision import get_policy
from minipar.errors import PipelineError
from minipar.nn import Block, Embedding, GPTConfig, LayerNorm, LMHead, Module
from minipar.nn.gpt import check_token_ids, initialize_parameters
from minipar.nn.layers import Dropout
from minipar.nn.recompute import Recompute, run_blocks


# --------------------------------------------------------------------------- stages
def split_layers(n_layer: int, num_stages: int, layer_split=None) -> list[range]:
    """The global layer indices of each of `num_stages` virtual stages, contiguous.

    Balanced by default: every stage gets n_layer // num_stages layers and the first
    n_layer % num_stages one more (the last stage also runs the head and loss, the
    heaviest extra). `layer_split` gives the counts explicitly, e.g. (3, 1); the first and
    last stage may be empty (they still hold the embedding / the head), the others not.
    """
    if layer_split is None:
        if num_stages > n_layer:
            raise PipelineError(
                f"--pp: {num_stages} pipeline stages (pp x virtual_stages) but the model has "
                f"{n_layer} layers (--n-layer): every stage needs at least one layer; use "
                f"at most {n_layer} stages or --n-layer {num_stages} or more")
        base, extra = divmod(n_layer, num_stages)
        counts = [base + (s < extra) for s in range(num_stages)]
    else:
        counts = [int(c) for c in layer_split]
        if len(counts) != num_stages:
            raise PipelineError(
                f"layer_split {tuple(counts)} has {len(counts)} entries for {num_stages} "
                f"stages (pp x virtual_stages): give one layer count per stage")
        if sum(counts) != n_layer:
            raise PipelineError(
                f"layer_split {tuple(counts)} adds up to {sum(counts)} layers but the model "
                f"has {n_layer} (--n-layer): make the counts add up to {n_layer}")
        for s, c in enumerate(counts):
            if c < 0 or (c == 0 and 0 < s < num_stages - 1):
                raise PipelineError(
                    f"layer_split {tuple(counts)}: stage {s} gets {c} layers; a middle stage "
                    f"needs at least 1 (only the first and last may be empty)")
    starts = np.cumsum([0] + counts)
    return [range(int(starts[s]), int(starts[s + 1])) for s in range(num_stages)]


class StageBlocks(Module):
    """A stage's transformer blocks, registered under their global layer index, so that
    parameter names read "h.5.attn.c_attn.weight" on whichever stage holds layer 5."""

    def __init__(self, blocks: dict[int, Block]):
        super().__init__()
        for index, block in blocks.items():
            setattr(self, str(index), block)
        self.blocks = list(blocks.values())

    def __iter__(self):
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)


class PipelineStage(Module):
    """Virtual stage `stage` of `num_stages`: the blocks `layers` (global indices), plus the
    embedding if it is the first stage and ln_f, head and loss if it is the last.

    forward(x, targets=None): x is idx (B, T) ints on the first stage, else the (B, T, d)
    activation of the previous stage. Returns the (B, T, d) output, or on the last stage the
    mean cross-entropy (logits (B, T, V) without targets). Built from the full fp64 initial
    weights (`init_parameter` by global name), so it starts equal to that part of `GPT`.
    """

    def __init__(self, config: GPTConfig, stage: int, num_stages: int, layers: range, *,
                 seed: int = 0, precision: str = "fp64",
                 activation_checkpointing: bool = False, recompute: Recompute | None = None):
        super().__init__()
        self.config = config
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.layers = layers
        self.activation_checkpointing = activation_checkpointing
        # Megatron applies --recompute-method block / uniform to each chunk's own layers.
        self.recompute = recompute if recompute is not None else Recompute.from_settings(
            activation_checkpointing)
        dtype = get_policy(precision).param_dtype
        # Dropout masks are drawn per stage, so with dropout > 0 they differ from a
        # single-device run's (equivalence is checked with dropout 0).
        self.dropout_generator = np.random.default_rng([seed, zlib.crc32(b"dropout"), stage])
        gen = self.dropout_generator
        # True on the last stage's own copy of a tied embedding (kept equal to stage 0's).
        self.holds_tied_copy = False
        if self.is_first:
            self.wte = Embedding(config.vocab_size, config.d_model, dtype=dtype)
            self.wpe = Embedding(config.seq_len, config.d_model, dtype=dtype)
            self.drop = Dropout(config.dropout, gen)
        self.h = StageBlocks({i: Block(config, dtype=dtype, generator=gen,
                                       checkpoint_core_attention=self.recompute.selective,
                                       moe=config.is_moe_layer(i))
                              for i in layers})
        if self.is_last:
            self.ln_f = LayerNorm(config.d_model, dtype=dtype)
            if not config.tie_embeddings:
                self.lm_head = LMHead(config.vocab_size, config.d_model, dtype=dtype)
            elif not self.is_first:
                self.wte = Embedding(config.vocab_size, config.d_model, dtype=dtype)
                self.holds_tied_copy = True
        initialize_parameters(self, config, seed)  # names are global: "wte.weight", "h.5..."

    def embed(self, idx):
        """Token plus position embeddings, as GPT.embed: idx (B, T) ints -> (B, T, d)."""
        idx = check_token_ids(idx, self.config.seq_len, who="pipeline stage 0")
        return self.drop(self.wte(idx) + self.wpe.weight[:idx.shape[1]])

    def head(self, x, targets=None):
        """Final LayerNorm, LM head and loss, as GPT.head: (B, T, d) -> loss (or logits)."""
        x = self.ln_f(x)
        weight = self.wte.weight if self.config.tie_embeddings else self.lm_head.weight
        logits = F.linear(x, weight, None, transpose_weight=True)
        return logits if targets is None else F.cross_entropy(logits, targets)

    def forward(self, x, targets=None):
        return self.body(self.embed(x) if self.is_first else x, targets)

    def body(self, x, targets=None):
        """The stage after its embedding: blocks (and head and loss on the last stage) on
        the (B, T, d) stage input x, where a split backward's B stops."""
        generator = self.dropout_generator if self.config.dropout > 0 else None
        x = run_blocks(self.h, x, self.recompute, generator)
        return self.head(x, targets) if self.is_last else x


class StageInput(Tensor):
    """A received activation: a leaf whose gradient is sent back to the previous stage.
    Its .grad is a transient "buffers" array, not a parameter gradient."""

    __slots__ = ()
    grad_category = "buffers"
