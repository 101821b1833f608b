"""Exercise 11: predict the activation bytes a training run keeps for backward.

Check your work:   python -m exercises.check 11

Exercise 06 predicts parameters, gradients, optimizer state and traffic; this one
predicts the rest of a rank's memory, the activations: what forward saves for backward.
It runs in "core" mode: you predict the textbook part (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", sections 4 and 5), and the checker
hands you the terms that are minipar's own (`terms`, below). The checker trains each
configuration with minipar and compares with the ledger's measured peak of
"activations" on every rank (try `minipar train --json r.json` and read
ranks[r]["memory"]["activations"]).

The model: minipar's GPT-2 (no dropout), B = config.micro_batch_size sequences of
T = config.seq_len tokens, width d = config.d_model, a = config.n_head heads, t =
config.tp, activations in the parameters' dtype (fp64 8 bytes, fp32 4, bf16-mixed 2).

1. One transformer layer, one micro-batch, one TP rank (their eq. 1-2, without dropout,
   in minipar's convention). Forward saves, in elements:
       each of the two LayerNorms     its normalised input          B T d
       the QKV and MLP-in matmuls     their input (the LN output)   B T d   each
       attention                      Q, K and V of my heads        3 B T d / t
                                      the probabilities             B (a/t) T T
       the output projection          its input                     B T d / t
       the MLP                        the GELU's input and output   2 x 4 B T d / t
   The first three rows live on the replicated stream: with sequence parallelism
   (config.sequence_parallel) each rank keeps only T/t of those tokens (their 4.2.2).
   Not yours: each LayerNorm also keeps 1/std per token in fp32: `terms.norm_statistics`.
2. The peak of one rank. Without pipeline or recomputation: every layer's activations of
   one micro-batch, plus the embedding's (`terms.embedding`) and the head's (`terms.head`:
   the final norm, the logits' softmax, the targets). With recomputation
   (config.recompute_granularity == "full", their section 5): each layer keeps only its
   (B, T, d) input (T/t tokens with sequence parallelism), and backward recomputes one
   layer at a time, after the head's activations are freed: the peak is the larger of
   the end of forward (inputs + embedding + head) and a recomputing layer (inputs +
   embedding + one whole layer). With a pipeline (config.pp = p stages, 1F1B, m =
   config.grad_accum_steps micro-batches; rank r is stage (r // t) % p; stage s has
   n_layer // p layers, the first n_layer % p stages one more): stage s holds the
   activations of min(p - s, m) micro-batches at once (their 4.2.3), each with the
   embedding's on the first stage; the last stage holds one micro-batch's head.
Sizes in bytes. Do not import minipar.plan or minipar.train: the checker refuses them.
"""

from __future__ import annotations


def layer_activation_bytes(config) -> int:
    """Bytes one transformer layer saves for backward, for one micro-batch on one TP rank:
    the elements of step 1 above times the activations' bytes per element (without the
    LayerNorms' statistics)."""
    raise NotImplementedError("layer_activation_bytes: your code here")


def activation_peak(config, rank: int, terms) -> int:
    """The peak bytes of activations on rank `rank` (step 2 above). terms, per micro-batch:
    terms.norm_statistics  bytes of both LayerNorms' 1/std in one layer
    terms.embedding        bytes the embedding keeps (its token ids)
    terms.head             bytes the head keeps (final norm, softmax of the logits, targets)
    A layer holds layer_activation_bytes(config) + terms.norm_statistics."""
    raise NotImplementedError("activation_peak: your code here")
