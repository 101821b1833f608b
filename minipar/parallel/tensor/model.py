"""Megatron tensor parallelism (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"): a GPT cut over a TP group.

The pieces, one module each (Megatron-LM's `megatron/core/tensor_parallel/` split):

    mappings.py       f, g and the sequence-parallel regions: the only communication
    tensor_layers.py  ColumnParallelLinear, RowParallelLinear
    vocab.py          vocabulary-parallel embedding, LM head and cross-entropy
    sequence.py       sequence parallelism's linear layer, LayerNorm and parameters

This module puts them together. The MLP's c_fc (d, 4d) is column-parallel, GELU runs on
rank i's 4d/t hidden units, c_proj (4d, d) is row-parallel and one all-reduce sums the
partial outputs (the paper's figure 3a). Attention splits the same way by heads: c_attn
column-parallel (rank i computes q, k, v of its n_head/t heads), c_proj row-parallel
(figure 3b). So a layer costs 2 all-reduces of (B, T, d) forward (two g) and 2
backward (two f).

The token embedding and the tied LM head are split by vocabulary rows, and the loss is
a vocabulary-parallel cross-entropy, so the full (B, T, V) logits never exist (vocab.py).
LayerNorms, wpe and the row-parallel biases are replicated: they act on the replicated
residual stream, so their gradients come out identical on every TP rank without any
communication.

With `sequence_parallel` (Korthikanti et al. 2022; see sequence.py) the replicated
regions are cut along the sequence and g / f become reduce-scatter / all-gather. The
LayerNorm weights and row-parallel biases then see only 1/t of the tokens, so their
gradients are partial sums: they enter the graph through f, whose backward all-reduces
them, and come out identical on every TP rank (Megatron all-reduces them once per step
instead; we pay one small all-reduce per parameter and micro-batch, and nothing outside
backward has to remember to do it).

An MoE block's experts are each cut like the MLP, the router left whole
(`tensor_parallel_experts`, Megatron-core's expert tensor parallelism).

Entry points: `tensor_parallel_gpt(...)` builds a rank's model; `parallelize_tensor`
converts any module tree holding GPT pieces and `TensorParallelMixin` gives a pipeline
stage the matching embed/head; `counts_once_in_norm` says which pieces count in the
global gradient norm. Consolidating the pieces into the single-device state dict is
`minipar.train.checkpoint.assemble` (by placement), loading them back
`minipar.train.build.load_local_state`.
"""

from __future__ import annotations

from minipar.autograd.placement import Shard, StridedShard
from minipar.nn import (
    GPT,
    Block,
    Embedding,
    GPTConfig,
    LayerNorm,
    LMHead,
    Module,
    Parameter,
)
from minipar.nn.module import hook_point
from minipar.nn.moe import MoE
from minipar.parallel.tensor import vocab
from minipar.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minipar.parallel.tensor.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)
from minipar.parallel.tensor.sequence import SequenceParallelLayerNorm


# ---------------------------------------------------------------------------- the model
def validate_tensor_parallel(config: GPTConfig, tp: int, sequence_parallel: bool = False):
    """Refuse a model that does not split over `tp` ranks, naming the setting and fix."""
    if config.n_head % tp:
        options = [t for t in range(1, config.n_head + 1) if config.n_head % t == 0]
        raise ValueError(f"--tp {tp}: n_head={config.n_head} is not divisible by tp, and "
                         f"each rank must hold whole attention heads; choose --tp among "
                         f"{options} or --n-head a multiple of {tp}")
    if 4 * config.d_model % tp:  # implied by the heads check for a GPTConfig
        raise ValueError(f"--tp {tp}: the MLP width 4*d_model={4 * config.d_model} is not "
                         "divisible by tp; choose --d-model so that it is")
    if config.vocab_size % tp:
        padded = vocab.pad_vocab_size(config.vocab_size, tp)
        raise ValueError(f"--tp {tp}: vocab_size={config.vocab_size} is not divisible by tp, "
                         "so the vocabulary-parallel embedding cannot split it; pad it as "
                         f"Megatron does: --vocab-size {padded} (ids the data never uses)")
    if sequence_parallel and config.seq_len % tp:
        raise ValueError(f"--sequence-parallel: seq_len={config.seq_len} is not divisible by "
                         f"--tp {tp}; choose --seq-len a multiple of {tp}")
    if config.dropout > 0 and tp > 1:
        raise ValueError(
            f"--dropout {config.dropout} with --tp {tp}: dropout under tensor parallelism "
            "needs Megatron's RNG tracker (same masks in replicated regions, different "
            "ones in split regions) and is not implemented; use --dropout 0")


def parallelize_tensor(module: Module, config: GPTConfig, tp_group, *,
                       sequence_parallel: bool = False) -> Module:
    """Swap, in place, the GPT pieces of `module` for their tensor-parallel versions and
    keep this rank's slices of their current (full) weights. Returns `module`.

    Handles any tree (a whole GPT or a pipeline stage): every Block's c_attn / c_fc
    (column-parallel) and c_proj (row-parallel), an Embedding named `wte`
    (vocabulary-parallel), an LMHead, and, with sequence parallelism, every Block's
    LayerNorms and a LayerNorm named `ln_f`. Every parameter gets placement_group "tp";
    those left whole are Replicate(). The code that calls the embedding and the head
    must use the sequence-parallel and vocabulary-parallel functions (sequence.py,
    vocab.py), as `TensorParallelGPT.embed` and `.head` do.
    """
    validate_tensor_parallel(config, tp_group.size, sequence_parallel)
    sp = sequence_parallel
    for path, parent in list(module.named_modules()):
        prefix = f"{path}." if path else ""  # names in placement errors: "h.0.attn.c_proj"
        if isinstance(parent, Block):
            attn, mlp = parent.attn, parent.mlp
            attn.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, tp_group, stride=3,
                                                           sequence_parallel=sp)
            attn.c_proj = RowParallelLinear.from_linear(attn.c_proj, tp_group,
                                                        sequence_parallel=sp,
                                                        name=f"{prefix}attn.c_proj")
            if isinstance(mlp, MoE):
                tensor_parallel_experts(mlp, tp_group, sp, f"{prefix}mlp")
            else:
                mlp.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, tp_group,
                                                            sequence_parallel=sp)
                mlp.c_proj = RowParallelLinear.from_linear(mlp.c_proj, tp_group,
                                                           sequence_parallel=sp,
                                                           name=f"{prefix}mlp.c_proj")
            if sp:
                parent.ln_1 = SequenceParallelLayerNorm(parent.ln_1, tp_group, f"{prefix}ln_1")
                parent.ln_2 = SequenceParallelLayerNorm(parent.ln_2, tp_group, f"{prefix}ln_2")
            continue
        for name, child in list(parent.named_children()):
            if name == "wte" and type(child) is Embedding:
                setattr(parent, name, vocab.VocabParallelEmbedding(child, tp_group))
            elif type(child) is LMHead:
                setattr(parent, name, vocab.VocabParallelLMHead(child, tp_group))
            elif sp and name == "ln_f" and type(child) is LayerNorm:
                setattr(parent, name, SequenceParallelLayerNorm(child, tp_group,
                                                                f"{prefix}{name}"))
    for p in module.parameters():
        p.placement_group = "tp"
    return module


def tensor_parallel_experts(moe: MoE, tp_group, sequence_parallel: bool, name: str) -> None:
    """Cut every expert of `moe` as the dense MLP is cut (Megatron-core's expert tensor
    parallelism, megatron/core/transformer/moe/experts.py: linear_fc1 column-parallel,
    linear_fc2 row-parallel within each expert): expert e's c_fc (d, 4d) by columns,
    its c_proj (4d, d) by rows, one all-reduce (g) per expert summing its partial output.
    The router stays whole on every TP rank: the tokens are replicated over TP, so
    every rank routes them identically, and the all-to-all runs over the ep group (the
    ranks with my TP index).

    With sequence parallelism my ranks hold (B, T/t, d) pieces: the layer all-gathers
    them first (its backward keeps my piece of the gradient, which every rank computed
    whole) and hands back my piece of its output, so routing sees the single device's
    N tokens and capacity. Megatron instead routes each rank's own N/t tokens
    (capacity per piece) and all-gathers over TP after the all-to-all
    (token_dispatcher.py `MoEAlltoAllTokenDispatcher.dispatch_postprocess`), which
    sends 1/t of the bytes but drops different tokens than one device would."""
    for e in moe.experts.ids:
        expert = moe.experts.local(e)
        expert.c_fc = ColumnParallelLinear.from_linear(expert.c_fc, tp_group)
        expert.c_proj = RowParallelLinear.from_linear(expert.c_proj, tp_group,
                                                      name=f"{name}.experts.{e}.c_proj")
    if sequence_parallel:
        moe.enter_region = lambda x: gather_from_sequence_parallel_region(
            x, tp_group, tensor_parallel_output_grad=False)
        moe.leave_region = lambda y: scatter_to_sequence_parallel_region(y, tp_group)


class TensorParallelMixin:
    """`embed` and `head` of one TP rank, for any Module shaped like GPT (a GPT, or a
    pipeline stage with GPT's embed/head: wte, wpe, drop, ln_f, lm_head, config).

        class TensorParallelStage(TensorParallelMixin, PipelineStage): ...
        stage = TensorParallelStage(...).tensor_parallel(tp_group, sequence_parallel)
    """

    tp_group = None
    sequence_parallel = False

    def tensor_parallel(self, tp_group, sequence_parallel: bool = False):
        """Convert this module in place (`parallelize_tensor`); returns it."""
        parallelize_tensor(self, self.config, tp_group, sequence_parallel=sequence_parallel)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        return self

    @hook_point
    def embed(self, idx):
        """idx (B, T) -> (B, T, d) replicated, or my (B, T/t, d) sequence piece."""
        x = super().embed(idx)  # wte's g makes the token embedding whole on every rank
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return x

    @hook_point
    def head(self, x, targets=None):
        """Mean cross-entropy from my vocabulary slice of the logits; without targets,
        the full logits (B, T, V), all-gathered (for generation only)."""
        x = self.ln_f(x)
        if self.config.tie_embeddings:
            weight, vocab_start = self.wte.weight, self.wte.vocab_start
        else:
            weight, vocab_start = self.lm_head.weight, self.lm_head.vocab_start
        logits = vocab.vocab_parallel_logits(x, weight, self.tp_group, self.sequence_parallel)
        if targets is None:
            return gather_from_tensor_parallel_region(logits, self.tp_group)
        return vocab.vocab_parallel_cross_entropy(logits, targets, vocab_start, self.tp_group)


class TensorParallelGPT(TensorParallelMixin, GPT):
    """One TP rank's GPT: same names and forward as `GPT`, its weights this rank's
    pieces. `model(idx, targets)` returns the same loss on every rank of the group."""

    def __init__(self, config: GPTConfig, seed: int = 0, precision: str = "fp64", *,
                 tp_group, sequence_parallel: bool = False,
                 activation_checkpointing: bool = False, recompute=None):
        validate_tensor_parallel(config, tp_group.size, sequence_parallel)
        # The full model first (the same initial weights as single-device), then my slices.
        super().__init__(config, seed, precision, activation_checkpointing, recompute)
        self.tensor_parallel(tp_group, sequence_parallel)


def tensor_parallel_gpt(config: GPTConfig, seed: int, precision: str, tp_group,
                        sequence_parallel: bool = False,
                        activation_checkpointing: bool = False,
                        recompute=None) -> TensorParallelGPT:
    """This rank's tensor-parallel GPT (the training loop's entry point). recompute: a
    minipar.nn.Recompute policy (selective, or full for some blocks)."""
    return TensorParallelGPT(config, seed, precision, tp_group=tp_group,
                             sequence_parallel=sequence_parallel,
                             activation_checkpointing=activation_checkpointing,
                             recompute=recompute)


# ---------------------------------------------------------------------------- the norm
def counts_once_in_norm(parameter: Parameter, tp_rank: int) -> bool:
    """Does this rank's piece count towards the global gradient norm? Split pieces on
    every rank (they are disjoint), replicated ones only on TP rank 0 (else they would
    count t times). The engines (minipar/parallel/data/ddp.py, zero.py) sum the counted
    squares over the TP group (`norm_groups`), as Megatron's `clip_grad_norm_fp32` does."""
    split = isinstance(parameter.placement, (Shard, StridedShard))
    return split or tp_rank == 0


__all__ = [
    "TensorParallelGPT",
    "TensorParallelMixin",
    "counts_once_in_norm",
    "parallelize_tensor",
    "tensor_parallel_experts",
    "tensor_parallel_gpt",
    "validate_tensor_parallel",
]
