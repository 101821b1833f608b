"""Exercise 06: predict, per rank, the bytes a training run holds and sends.

Check your work:   python -m exercises.check 06

Before you rent 1024 GPUs you predict, with a pencil, what each one will hold and send.
Here you write that prediction as code, and the checker trains each configuration with
minipar and compares it with what the ranks measured (the report's ranks[r]["memory"] and
ranks[r]["comm"]["by_group"]; try `minipar train --dp 2 --zero 2 --json r.json`).

Read: Rajbhandari et al. 2020, "ZeRO" (section 3: 2 + 2 + 12 bytes per parameter;
section 5 and figure 1: what each stage shards; section 7: communication) and Shoeybi et
al. 2019, "Megatron-LM" (section 3: what tensor parallelism splits and where it
all-reduces); minipar/parallel/zero/stage_1_and_2.py and tensor.py say when each collective runs.

The configurations: a small GPT over a dp x pp x tp mesh (N = config.dp, p = config.pp,
t = config.tp; rank r has TP rank r % t, pipeline stage (r // t) % p and DP rank
r // (t p), Megatron's order), ZeRO stage config.zero (0 = plain DP), precision fp64,
fp32 or bf16-mixed, A = config.grad_accum_steps micro-batches of
B = config.micro_batch_size sequences of T = config.seq_len tokens per step,
config.steps steps, one gradient bucket (all gradients in one flat buffer). They are
chosen so that every split is even (no padding); TP and PP are not combined.

Memory, the *peak* bytes per category from each rank's ledger:
    params      the parameters the rank keeps (its TP slices; all of them, or a ZeRO shard)
    grads       the gradients it keeps: the full p.grad, or only its shard when ZeRO
                shards gradients (the full gradients are then transient "buffers")
    optimizer   AdamW's m and v in the parameters' dtype, plus fp32 master weights in
                bf16-mixed (then 4 + 4 + 4 = 12 bytes per element, the paper's K = 12)
  Bytes per element: fp64 8, fp32 4, bf16 2; gradients and activations have the
  parameters' dtype. Under TP, matrices (and the column-parallel biases, and the
  vocabulary rows of wte) are split t ways; LayerNorms, wpe and the row-parallel biases
  (attn.c_proj.bias, mlp.c_proj.bias) are replicated on every TP rank.

Pipeline stages (Megatron-LM's pre_process / post_process; minipar/parallel/pipeline/stage.py):
  stage s holds blocks of its own, n_layer // p each, the first n_layer % p stages one
  more; the first stage also wte and wpe, the last also ln_f and the head: lm_head when
  untied, and when tied its *own copy* of wte (kept equal to the first stage's). Every
  DP formula below then uses the parameters of the rank's stage.

Traffic, the bytes this rank *sent* over the whole run, per group ("dp", "tp", "pp"). Ring
algorithm, S = bytes of the full tensor: all-reduce 2(n-1)/n S; reduce-scatter and
all-gather (n-1)/n S, over a group of n ranks.
  DP group, over the rank's local parameters (DeepSpeed's semantics):
    stage 0  one all-reduce of all gradients per step, after the last micro-batch
    stage 1  one reduce-scatter per step after the last micro-batch; after AdamW, one
             all-gather of the updated parameters
    stage 2  a reduce-scatter after *every* micro-batch's backward (no full gradient is
             left to accumulate into); one all-gather per step after AdamW
    stage 3  gradients as stage 2; parameters exist only as shards, so each module
             all-gathers its parameters before its forward and again before its backward
             (and frees them after); no all-gather after AdamW. Gather units: "embed"
             (wte, wpe), each block h.i, "head" (ln_f, and lm_head when untied). With
             tied embeddings the head's matmul uses wte, so the head's forward needs the
             embed unit too; in backward a unit stays gathered until its gradients are
             complete.
  TP group, per micro-batch, all-reduces of (B, T, d) activations: forward, one after
  the vocabulary-parallel embedding and one after each row-parallel layer (2 per block);
  backward, one before each column-parallel layer (2 per block) and one for the LM head's
  input (the logits stay split by vocabulary: x enters the head through f). The
  vocabulary-parallel cross-entropy adds, in forward, an all-reduce of B*T numbers (the
  max logit of each token) and one of 2*B*T (the sum of exponentials and the target's
  logit), in the activations' dtype.
  PP group, per micro-batch, point-to-point sends of one (B, T, d) activation in the
  activations' dtype: forward, every stage but the last sends its output to the next;
  backward, every stage but the first sends the gradient of its input to the previous.
  Per step: the last stage broadcasts the step's mean loss (one float64, 8 bytes sent by
  the last stage when p = 2); with a tied head the first and last stage all-reduce the
  gradient of their wte copies (a group of 2: Megatron's embedding group).
  Gradient clipping needs the norm of the whole gradient: once per step, one float64
  (the squared norm) is all-reduced over the TP group when t > 1, over the PP group when
  p > 1, and over the DP group when ZeRO shards the gradients' state (stages 1-3). A
  ring cannot cut one element into n chunks, so its bytes depend on the rank:
  `dist.all_reduce_bytes(1, 8, n, i)[0]` for position i in a group of n.
"""

from __future__ import annotations

from minipar import distributed as dist  # noqa: F401 - dist.all_reduce_bytes for the one-element all-reduce


def count_parameters(config) -> int:
    """Ψ, the number of parameters of the full GPT of `config` (a minipar TrainConfig with
    vocab_size V, seq_len T, n_layer L, d_model d, tie_embeddings).

    GPT-2's layout (docs/design.md): wte (V, d), wpe (T, d); per block ln_1 and ln_2 (weight and
    bias, d each), attn.c_attn (d, 3d) + bias, attn.c_proj (d, d) + bias, mlp.c_fc
    (d, 4d) + bias, mlp.c_proj (4d, d) + bias; ln_f; lm_head (V, d) only when untied.
    """
    raise NotImplementedError("count_parameters: your code here")


def predict_rank(config, rank: int) -> dict[str, int]:
    """What rank `rank` holds and sends in a run of `config`, in bytes:

        {"params": peak, "grads": peak, "optimizer": peak, "dp": sent, "tp": sent,
         "pp": sent}

    Settings you need: config.dp, config.tp, config.pp, config.zero, config.precision,
    config.grad_accum_steps, config.micro_batch_size, config.steps, and the model fields.
    Hint: first count the parameters one TP rank holds; every DP formula uses that.
    """
    raise NotImplementedError("predict_rank: your code here")
