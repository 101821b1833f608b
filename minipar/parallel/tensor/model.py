"""Megatron tensor parallelism (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"): a GPT cut over a TP group.

Llama's shapes cut the same way: grouped-query attention's c_attn holds, per key/value
head, its group's query heads and its k and v (Megatron's layout), so rank i keeps
n_kv_head/t whole groups (a plain column cut); SwiGLU's c_fc ([gate | up], stride 2)
so that rank i holds gate_i and up_i.

`parallelize_tensor` converts a built GPT (whole, or a pipeline stage's layers) in place,
swapping its modules for the tensor-parallel ones and keeping this rank's slices of their
full weights. The MLP's c_fc (d, 4d) is column-parallel, GELU runs on rank i's 4d/t
hidden units, c_proj (4d, d) is row-parallel and one all-reduce sums the partial outputs
(the paper's figure 3a). Attention splits the same way by heads: c_attn column-parallel
(rank i computes q, k, v of its n_head/t heads), c_proj row-parallel (figure 3b). So a
layer costs 2 all-reduces of (B, T, d) forward (two g) and 2 backward (two f).

The token embedding and the LM head are split by vocabulary rows, and the loss is a
vocabulary-parallel cross-entropy, so the full (B, T, V) logits never exist (vocab.py).
LayerNorms, wpe and the row-parallel biases are replicated: they act on the replicated
residual stream, so their gradients come out identical on every TP rank without any
communication. With `sequence_parallel` (sequence.py) those regions are cut along the
sequence instead, and the LayerNorm and bias gradients become partial sums that a
training run all-reduces over TP once per step (sequence_grads.py).

`counts_once_in_norm` says which pieces count in the global gradient norm.
Consolidating the pieces into the single-device state dict is
`minipar.train.checkpoint.assemble` (by placement).
"""

from __future__ import annotations

from minipar.autograd.placement import Shard, StridedShard
from minipar.nn import GPT, GPTConfig, Parameter
from minipar.nn.moe import MoE
from minipar.parallel.tensor import sequence
from minipar.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minipar.parallel.tensor.vocab import (
    VocabParallelCrossEntropyLoss,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    pad_vocab_size,
)


def parallelize_tensor(model: GPT, config: GPTConfig, tp_group, *,
                       sequence_parallel: bool = False) -> GPT:
    """Convert `model` (a GPT, or a pipeline stage's) in place to one TP rank's: every
    block's c_attn / c_fc column-parallel and c_proj row-parallel (an MoE block's
    experts each so), wte, the LM head and the loss vocabulary-parallel; with
    `sequence_parallel` also the LayerNorms and the scatter after the embedding.
    Parameters get placement_group "tp"; those left whole are Replicate(). Returns it."""
    validate_tensor_parallel(config, tp_group.size, sequence_parallel)
    sp = sequence_parallel
    column = sequence.SequenceParallelColumnLinear if sp else ColumnParallelLinear
    row = sequence.SequenceParallelRowLinear if sp else RowParallelLinear
    gated = 2 if config.mlp == "swiglu" else 1  # SwiGLU's c_fc: [gate | up], each cut
    for i, block in zip(model.layers, model.h, strict=True):
        name = f"h.{i}"  # names the layers in placement errors
        # [q | k | v] cut by heads in each block; grouped-query attention's groups are
        # contiguous (Megatron's layout): whole groups by plain columns
        block.attn.c_attn = column.from_linear(block.attn.c_attn, tp_group,
                                               stride=1 if config.grouped_query else 3)
        block.attn.c_proj = row.from_linear(block.attn.c_proj, tp_group,
                                            name=f"{name}.attn.c_proj")
        if isinstance(block.mlp, MoE):
            tensor_parallel_experts(block.mlp, tp_group, sp, f"{name}.mlp")
        else:
            block.mlp.c_fc = column.from_linear(block.mlp.c_fc, tp_group, stride=gated)
            block.mlp.c_proj = row.from_linear(block.mlp.c_proj, tp_group,
                                               name=f"{name}.mlp.c_proj")
        if sp:
            block.ln_1 = sequence.SequenceParallelLayerNorm(block.ln_1, tp_group, f"{name}.ln_1")
            block.ln_2 = sequence.SequenceParallelLayerNorm(block.ln_2, tp_group, f"{name}.ln_2")
    if hasattr(model, "wte"):  # the first stage's, or the last stage's tied copy
        model.wte = VocabParallelEmbedding(model.wte, tp_group)
    if model.pre_process and sp:
        model.scatter_to_sequence_parallel = sequence.SequenceParallelScatter(tp_group)
    if model.post_process:
        head = sequence.SequenceParallelLMHead if sp else VocabParallelLMHead
        model.lm_head = head(model.lm_head, tp_group)
        model.lm_loss = VocabParallelCrossEntropyLoss(config.vocab_size, tp_group)
        if sp:
            model.ln_f = sequence.SequenceParallelLayerNorm(model.ln_f, tp_group, "ln_f")
    for p in model.parameters():
        p.placement_group = "tp"
    return model


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
        moe.gather_from_sequence_parallel = sequence.SequenceParallelGather(
            tp_group, tensor_parallel_output_grad=False)
        moe.scatter_to_sequence_parallel = sequence.SequenceParallelScatter(tp_group)


def tensor_parallel_gpt(config: GPTConfig, seed: int, precision: str, tp_group,
                        sequence_parallel: bool = False, recompute=None) -> GPT:
    """This rank's tensor-parallel GPT: the full model built (the same initial weights as
    one device), then converted. recompute: a minipar.nn.Recompute policy."""
    return parallelize_tensor(GPT(config, seed, precision, recompute), config, tp_group,
                              sequence_parallel=sequence_parallel)


def validate_tensor_parallel(config: GPTConfig, tp: int, sequence_parallel: bool = False):
    """Refuse a model that does not split over `tp` ranks, naming the setting and fix."""
    if config.n_head % tp:
        options = [t for t in range(1, config.n_head + 1) if config.n_head % t == 0]
        raise ValueError(f"--tp {tp}: n_head={config.n_head} is not divisible by tp, and "
                         f"each rank must hold whole attention heads; choose --tp among "
                         f"{options} or --n-head a multiple of {tp}")
    if config.kv_heads % tp:
        options = [t for t in range(1, config.kv_heads + 1) if config.kv_heads % t == 0]
        raise ValueError(f"--tp {tp}: n_kv_head={config.kv_heads} is not divisible by tp, and "
                         f"each rank must hold whole key/value heads (Megatron's rule); "
                         f"choose --tp among {options}")
    if config.ffn % tp:
        raise ValueError(f"--tp {tp}: the MLP width {config.ffn} is not divisible by tp; "
                         "choose --d-ff (or --d-model) so that it is")
    if config.vocab_size % tp:
        raise ValueError(f"--tp {tp}: vocab_size={config.vocab_size} is not divisible by tp, "
                         "so the vocabulary-parallel embedding cannot split it; pad it as "
                         f"Megatron does: --vocab-size {pad_vocab_size(config.vocab_size, tp)}"
                         " (ids the data never uses)")
    if sequence_parallel and config.seq_len % tp:
        raise ValueError(f"--sequence-parallel: seq_len={config.seq_len} is not divisible by "
                         f"--tp {tp}; choose --seq-len a multiple of {tp}")
    if config.dropout > 0 and tp > 1:
        raise ValueError(
            f"--dropout {config.dropout} with --tp {tp}: dropout under tensor parallelism "
            "needs Megatron's RNG tracker (same masks in replicated regions, different "
            "ones in split regions) and is not implemented; use --dropout 0")


def counts_once_in_norm(parameter: Parameter, tp_rank: int) -> bool:
    """Does this rank's piece count towards the global gradient norm? Split pieces on
    every rank (they are disjoint), replicated ones only on TP rank 0 (else they would
    count t times). The engines (minipar/parallel/data/ddp.py, zero/) sum the counted
    squares over the TP group (`norm_groups`), as Megatron's `clip_grad_norm_fp32` does."""
    split = isinstance(parameter.placement, (Shard, StridedShard))
    return split or tp_rank == 0
