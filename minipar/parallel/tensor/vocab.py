"""Vocabulary parallelism: the token embedding, the LM head and the cross-entropy split
by vocabulary rows over a tensor-parallel group (Shoeybi et al. 2019, section 3: "we
parallelize the input embedding weight matrix along the vocabulary dimension ... and
fuse the output GEMM with the cross entropy loss"; Megatron-LM's VocabParallelEmbedding
and _VocabParallelCrossEntropy).

Rank i owns tokens [i V/t, (i+1) V/t): rows (V/t, d) of wte (and of an untied lm_head).

    embedding     look up the tokens I own, zeros for the others, then g (all-reduce)
    logits        x @ W_i.T -> (B, T, V/t): my words only, no communication
    cross-entropy max all-reduce and sum all-reduce of (B, T) numbers per token

So the (B, T, V) logits, the largest activation of a small-vocabulary-heavy model, never
exist on any rank, and each rank's softmax and its gradient cover only V/t words.

A vocabulary that does not divide by t is refused, naming the padded size: Megatron pads
the vocabulary to a multiple of t (the extra ids are never produced by the tokenizer);
here the same padding is `--vocab-size` (`pad_vocab_size`), so the single-device
reference has the same padded rows and the runs stay comparable.
"""

from __future__ import annotations

import numpy as np

from minipar import distributed as dist
from minipar.autograd import functional as F
from minipar.autograd.function import Function
from minipar.autograd.placement import Shard, partial
from minipar.autograd.precision import compute_dtype
from minipar.autograd.tensor import Tensor
from minipar.nn import Embedding, LMHead, Module
from minipar.parallel.tensor.layers import shard_parameter
from minipar.parallel.tensor.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """The smallest multiple of tp >= vocab_size (Megatron pads the vocabulary so that
    it splits; the extra rows are ids the data never uses)."""
    return -(-vocab_size // tp) * tp


class VocabParallelLookup(Function):
    """Rows of my vocabulary shard (V/t, d) for the tokens I own, zeros for the others:
    a Partial() embedding that g completes. idx (B, T) ints -> (B, T, d)."""

    @staticmethod
    def forward(ctx, idx, weight, vocab_start):
        local = np.asarray(idx) - vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        local[outside] = 0
        out = weight.take(local, axis=0)
        out[outside] = 0
        ctx.save_for_backward(local, outside)
        ctx.weight_shape, ctx.dtype = weight.shape, weight.dtype
        ctx.flops_backward = local.size * weight.shape[1]
        return out

    @staticmethod
    def backward(ctx, grad):
        local, outside = ctx.saved_tensors
        work = compute_dtype(ctx.dtype)
        grad_weight = np.zeros(ctx.weight_shape, dtype=work)
        inside = ~outside.reshape(-1)
        rows = grad.reshape(-1, ctx.weight_shape[1])[inside].astype(work, copy=False)
        np.add.at(grad_weight, local.reshape(-1)[inside], rows)
        return None, grad_weight.astype(ctx.dtype, copy=False), None


class VocabParallelEmbedding(Module):
    """The token embedding split by vocabulary rows: weight (V/t, d), Shard(0).

    Rank i owns tokens [i V/t, (i+1) V/t). idx (B, T) -> (B, T, d) replicated."""

    def __init__(self, embedding: Embedding, group):
        super().__init__()
        vocab = embedding.weight.shape[0]
        if vocab % group.size:
            raise ValueError(f"vocabulary parallelism: vocab_size={vocab} is not divisible "
                             f"by --tp {group.size}; pad it as Megatron does: --vocab-size "
                             f"{pad_vocab_size(vocab, group.size)}")
        self.vocab_size, self.group = vocab, group
        self.weight = shard_parameter(embedding.weight.data, Shard(0), group)
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, idx):
        idx = np.asarray(idx.data if isinstance(idx, Tensor) else idx)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"embedding: indices must be integers, got {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.vocab_size):
            raise ValueError(f"embedding: indices must lie in [0, {self.vocab_size}), got "
                             f"values in [{idx.min()}, {idx.max()}]")
        mine = partial(VocabParallelLookup.apply(idx, self.weight, self.vocab_start),
                       "wte (VocabParallelEmbedding)", "g (reduce_from_tensor_parallel_region)")
        return reduce_from_tensor_parallel_region(mine, self.group)


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy from vocabulary-split logits (Megatron's
    _VocabParallelCrossEntropy): logits (B, T, V/t) of my words, targets (B, T) full ids.

        m   = all_reduce_max(max of my logits)            per token
        z   = my logits - m
        s,p = all_reduce_sum(sum exp z,  z[target] if I own the target else 0)
        loss = mean(log s - p)

    One max and one sum all-reduce of (B, T) values each (s and p travel together);
    the gradient (softmax - onehot) / N is local, so backward communicates nothing.
    The arithmetic is the single-device loss's (functional.py's pieces), with the two
    all-reduces between them.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        targets = np.asarray(targets)
        vocab_piece = logits.shape[-1]
        F.check_targets(targets, logits.shape, vocab_piece * group.size)
        z, row_max = F.logits_max(logits)
        row_max = dist.all_reduce(row_max, op="max", group=group)
        local = targets.reshape(-1) - vocab_start
        mine = (local >= 0) & (local < vocab_piece)
        local[~mine] = 0
        sums = F.predicted_logits_and_sum_exp(z, row_max, local, mine)
        sums = dist.all_reduce(sums, group=group)  # sum exp and target logit together
        loss = F.cross_entropy_loss(z, sums)  # z is my slice of the softmax now
        ctx.save_for_backward(z.astype(logits.dtype, copy=False), local, mine)
        ctx.logits_shape = logits.shape
        ctx.flops_forward = 5 * z.size
        ctx.flops_backward = 2 * z.size
        return loss

    @staticmethod
    def backward(ctx, grad):
        probs, local, mine = ctx.saved_tensors
        grad_logits = F.cross_entropy_gradient(probs, local, grad, mine)
        return grad_logits.reshape(ctx.logits_shape), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets, vocab_start: int, group) -> Tensor:
    """Mean cross-entropy of vocabulary-split logits; see `VocabParallelCrossEntropy`."""
    if isinstance(targets, Tensor):
        targets = targets.data
    return VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group)


class VocabParallelLMHead(Module):
    """The LM head split by vocabulary rows: my logits x @ W_i.T, W_i (V/t, d) my rows of
    an untied head's weight (Shard(0)), or of the weight passed in (the vocabulary-
    parallel wte of a tied head). x (B, T, d) replicated -> (B, T, V/t), or with
    `gather_output` (generation only) the whole (B, T, V) on every rank."""

    def __init__(self, head: LMHead, group):
        super().__init__()
        self.group = group
        if hasattr(head, "weight"):
            self.weight = shard_parameter(head.weight.data, Shard(0), group)

    def forward(self, x, weight=None, gather_output: bool = False):
        logits = self.logits(x, self.weight if weight is None else weight)
        if gather_output:
            return gather_from_tensor_parallel_region(logits, self.group)
        return logits

    def logits(self, x, weight):
        """f, then x @ W_i.T (no communication forward)."""
        return F.linear(copy_to_tensor_parallel_region(x, self.group), weight, None,
                        transpose_weight=True)


class VocabParallelCrossEntropyLoss(Module):
    """The LM loss from my vocabulary's logits (`VocabParallelCrossEntropy`)."""

    def __init__(self, vocab_size: int, group):
        super().__init__()
        self.group = group
        self.vocab_start = dist.get_rank(group) * (vocab_size // group.size)

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.group)
