"""Whose bytes: what the planner counts for a rank, by the system that will run the job.

`minipar plan --memory-accounting paper|megatron|deepspeed` (ParallelConfig's
`memory_accounting`). Each accounting starts from the same per-tensor model (memory.py:
the ZeRO paper's model states, Korthikanti et al. 2022's activations) and changes what
that system does differently, each change a named `Term` the plan prints:

    paper      minipar's emulator, which the planner matches byte for byte
               (tests/plan/test_estimate.py): the model states in the layout's dtypes
               (2 + 2 + 12 bytes per parameter with bf16 gradient buffers, 2 + 4 + 12 with
               fp32 ones), the activations its kernels save, flat copies of the gradients
               while they are reduced.
    megatron   what Megatron-LM allocates (megatron/core/distributed/
               param_and_grad_buffer.py, distrib_optimizer.py, tensor_parallel/
               cross_entropy.py; megatron/training/theoretical_memory_usage.py):
               - the cross-entropy upcasts the logits: the last stage keeps its
                 (b, s, V/t) softmax in fp32 (`compute_activation_memory`'s
                 4 sbh (1 + V/h));
               - gradients are reduced in place in the contiguous grad buffer, and the
                 distributed optimizer gathers parameters into the param buffer: no flat
                 copies;
               - the theoretical estimate's 5% on activations for temporaries, unless it
                 uses its sequence-parallel + selective path (`overhead_factor = 1.05` in
                 `compute_activation_memory_without_sp`).
               Megatron's own ZeRO is its distributed optimizer (ZeRO-1): ZeRO-2/3 are
               DeepSpeed's (or Megatron-FSDP, which the estimate does not cover).
    deepspeed  what DeepSpeed allocates (deepspeed/runtime/zero/stage_1_and_2.py,
               stage3.py, and their estimators `estimate_zero2_model_states_mem_needs`,
               `estimate_zero3_model_states_mem_needs`):
               - with ZeRO, gradients accumulate in the model's dtype unless
                 `data_types.grad_accum_dtype` says otherwise (engine.get_data_types):
                 bf16 gradients (whole under stage 1, partitioned under 2 and 3) plus the
                 fp32 copy of my partition the optimizer steps from: the estimators'
                 "2_grads_16bit + 4_grads_32bit" of 18 bytes per parameter; stage 1 with
                 fp32 accumulation is its BF16_Optimizer (fp32 gradients, whole);
               - gradients reduced through `reduce_bucket_size` buckets (5e8 elements, two
                 with overlap_comm), not one flat copy;
               - ZeRO-3 gathers module by module: the estimator's 4 bytes (bf16 parameter
                 and gradient) of the largest module (`largest_layer_params`), where minipar
                 gathers whole layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minipar.errors import ConfigError
from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.plan.shapes import ModelShape, padded_vocab

ACCOUNTINGS = ("paper", "megatron", "deepspeed")
# DeepSpeed's defaults for the reduction buckets (deepspeed/runtime/zero/config.py: 5e8
# elements), what the exported ds_config.json sets for a plan of one bucket
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# compute_activation_memory_without_sp: "buffer for optimizer and miscellaneous temporaries"
MEGATRON_ACTIVATION_OVERHEAD = 0.05


def reduce_bucket_elements(config) -> int:
    """DeepSpeed's `reduce_bucket_size` of a plan (what its export writes): the plan's
    buckets in elements, or for a plan of one bucket DeepSpeed's default, since its
    IPG buffers are allocated at that size (stage_1_and_2.py), two with overlap_comm."""
    if config.bucket_size_mb > 0:
        return int(config.bucket_size_mb * 2**20 / config.bytes.param)
    return DEEPSPEED_REDUCE_BUCKET


def with_deepspeed_buckets(config):
    """`config` reducing ZeRO-2's gradients through DeepSpeed's reduce_bucket_size
    buckets (5e8 elements; minipar's bucket_size_mb counts parameter bytes, as DDP's
    bucket_cap_mb) rather than one flat copy of all of them, unless it sets its own."""
    if config.zero != 2 or config.bucket_size_mb > 0:
        return config
    return config.replace(bucket_size_mb=DEEPSPEED_REDUCE_BUCKET * config.bytes.param / 2**20)


@dataclass(frozen=True)
class Term:
    """Bytes one accounting adds to (or, negative, takes from) the paper's count of one
    category on one rank, and why."""

    name: str
    category: str
    nbytes: int


@dataclass(frozen=True)
class Ingredients:
    """A rank's bytes by what the peak is made of (memory.stage_memory adds them up):
    the model states, the gradients that persist, the activations at the forward peak,
    the buffers held with them, the gradient synchronisation's buffers; `gathered`, of
    forward_buffers, ZeRO-3's gathered parameters."""

    params: int
    grads: int
    optimizer: int
    activations: int
    forward_buffers: int
    sync_buffers: int
    gathered: int = 0


def check_accounting(accounting: str, zero: int) -> None:
    """The accounting exists and the system it names runs this ZeRO stage."""
    if accounting not in ACCOUNTINGS:
        raise ConfigError("memory_accounting", f"must be one of {', '.join(ACCOUNTINGS)}; "
                          f"got {accounting!r}")
    if accounting == "megatron" and zero > 1:
        raise ConfigError("memory_accounting", f"Megatron-LM's ZeRO is its distributed "
                          f"optimizer (ZeRO-1); ZeRO-{zero} is DeepSpeed's: use "
                          "--memory-accounting deepspeed (or paper), or --zero 0/1")


def account(shape: ModelShape, config, stage, parts: Ingredients, local: int, shard: int
            ) -> tuple[Ingredients, list[Term]]:
    """`parts` (the paper's count of one rank of `stage`, `local` parameters, `shard` of
    them its ZeRO partition) as config.memory_accounting counts them, with the terms."""
    if config.memory_accounting == "megatron":
        terms = megatron_terms(shape, config, stage, parts)
    elif config.memory_accounting == "deepspeed":
        terms = deepspeed_terms(shape, config, stage, parts, local, shard)
    else:
        return parts, []
    changed = {}
    for term in terms:
        changed[term.category] = changed.get(term.category, getattr(parts, term.category)
                                             ) + term.nbytes
    return replace(parts, **changed), terms


def megatron_terms(shape: ModelShape, config, stage, parts: Ingredients) -> list[Term]:
    b, t, a = config.micro_batch_size, config.tp, config.bytes.activation
    terms = []
    if stage.last and a < 4:
        heads = SCHEDULES[config.schedule].head_in_flight(config.pp, config.micro_batches,
                                                          config.virtual_stages)
        logits = b * (shape.seq_len // config.cp) * padded_vocab(shape.vocab_size, t) // t
        terms.append(Term("the cross-entropy's fp32 softmax of the logits (Megatron upcasts "
                          "them)", "activations", heads * logits * (4 - a)))
    if not (config.sequence_parallel and config.recompute.selective):
        activations = parts.activations + sum(t.nbytes for t in terms)
        terms.append(Term("theoretical_memory_usage.py's 5% for temporaries",
                          "activations", round(MEGATRON_ACTIVATION_OVERHEAD * activations)))
    if parts.sync_buffers:
        terms.append(Term("gradients reduced in place in the contiguous grad buffer (no "
                          "flat copies)", "sync_buffers", -parts.sync_buffers))
    return terms


def deepspeed_terms(shape: ModelShape, config, stage, parts: Ingredients, local: int,
                    shard: int) -> list[Term]:
    zero, g = config.zero, config.bytes.grad
    if zero == 0:
        return []
    terms = []
    bf16_optimizer = zero == 1 and config.grad_accum_dtype == "fp32"
    if config.precision == "bf16-mixed" and not bf16_optimizer:
        # the ZeRO optimizer: bf16 gradients (DeepSpeed's default with ZeRO) and the fp32
        # copy of my partition
        grads = 2 * (local if zero == 1 else shard) + 4 * shard
        paper = (local if zero == 1 else shard) * g  # the paper's gradient buffers
        terms.append(Term("bf16 gradients and the fp32 copy of my partition (the "
                          "estimators' 2 + 4 bytes)", "grads", grads - paper))
    bucket = min(local, reduce_bucket_elements(config)) * (
        2 if config.precision == "bf16-mixed" else g)
    if zero in (1, 2):
        terms.append(Term("gradients reduced through reduce_bucket_size buckets, two in "
                          "flight", "sync_buffers", 2 * bucket - parts.sync_buffers))
    if zero == 3:
        largest = largest_module_params(shape, config.tp, stage)
        terms.append(Term("the largest module's bf16 parameters and gradients gathered "
                          "(estimate_zero3's 4 x largest_layer_params), not whole layers",
                          "forward_buffers", 4 * largest - parts.gathered))
        terms.append(Term("gradients reduced through reduce_bucket_size buckets",
                          "sync_buffers", bucket - parts.sync_buffers))
    return terms


def largest_module_params(shape: ModelShape, tp: int, stage) -> int:
    """Parameters of the largest single module a rank of `stage` holds (weight and bias
    of one linear layer, or an embedding table): DeepSpeed's `largest_layer_params`
    (stage3.py `model_to_params`: parameters(recurse=False) of each module)."""
    h, bias = shape.d_model, int(shape.bias)
    vocab = padded_vocab(shape.vocab_size, tp) // tp * h
    sizes = [0]
    if stage.layers:
        sizes += [h * shape.qkv_width // tp + bias * shape.qkv_width // tp,
                  h * h // tp + bias * h,
                  h * shape.mlp_in_width // tp + bias * shape.mlp_in_width // tp,
                  shape.ffn // tp * h + bias * h]
    if stage.first or stage.tied_copy or (stage.last and not shape.tie_embeddings):
        sizes.append(vocab)
    return max(sizes)
